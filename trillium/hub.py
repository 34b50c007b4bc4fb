"""Where a `--model` comes from: a local path, or a Hugging Face Hub id resolved into its cache.

    resolve_model_path(model, revision=None, download_dir=None) -> local path
    check_no_remote_code(path, trust_remote_code) -> None (raises ValueError)

A `model` that exists on disk is used as it is. Anything else is taken as a
Hub repository id (`org/name`), as vLLM does: `huggingface_hub.snapshot_download`
fetches the files Trillium reads (config, tokenizer, safetensors; never
pickled `.bin` weights) into the standard cache (`HF_HOME` /
`HF_HUB_CACHE`, or `--download-dir`), at `--revision` (a branch, tag or
commit; default main), with tqdm progress bars while it downloads. With
`HF_HUB_OFFLINE=1` only the cache is read: a cached snapshot loads with no
network, a missing one is an error naming the cache directory.

Trillium never runs code from a model repository: a config whose
architecture is not one Trillium implements and that names remote code
(`auto_map`) is refused at start, whatever `--trust-remote-code` says.
"""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger(__name__)

# What the loader and tokenizer read; the weights only as safetensors (never pickle).
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt")


def is_local(model: str) -> bool:
    return os.path.exists(os.path.expanduser(model))


def resolve_model_path(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A local directory or file for `model` (see module doc); ValueError with the reason otherwise."""
    if is_local(model):
        if revision:
            log.info("--revision %s ignored for the local path %s", revision, model)
        return os.path.expanduser(model)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    cache = download_dir or constants.HF_HUB_CACHE
    offline = constants.HF_HUB_OFFLINE
    log.info("model %s is not a local path: resolving it on the Hugging Face Hub (revision %s, cache %s%s)",
             model, revision or "main", cache, ", offline" if offline else "")
    try:
        path = snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=list(ALLOW_PATTERNS), local_files_only=offline)
    except HFValidationError:
        raise ValueError(f"--model {model!r}: no such file or directory, and not a Hugging Face Hub id "
                         "(org/name)") from None
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes one start-up error
        hint = (" (HF_HUB_OFFLINE is set: only the cache is read; download it once without it)"
                if offline else "")
        raise ValueError(f"--model {model!r}: not a local path, and the Hub snapshot (revision "
                         f"{revision or 'main'}) is not available in {cache}{hint}: "
                         f"{type(exc).__name__}: {exc}") from None
    log.info("model %s resolved to %s", model, path)
    return path


def check_no_remote_code(path: str, trust_remote_code: bool = False) -> None:
    """Refuse a model that only remote code could run (Trillium never executes it)."""
    config_path = os.path.join(path, "config.json") if os.path.isdir(path) else ""
    if not config_path or not os.path.isfile(config_path):
        return  # GGUF, or no config: the loader reports what is missing
    with open(config_path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_path}: not valid JSON ({exc})") from None
    from trillium.models.config import SUPPORTED_ARCHITECTURES

    architectures = config.get("architectures") or []
    if "auto_map" in config and not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        classes = sorted(set(str(v) for v in config["auto_map"].values())) if isinstance(
            config["auto_map"], dict) else [str(config["auto_map"])]
        flag = "--trust-remote-code was given, but " if trust_remote_code else ""
        raise ValueError(
            f"{path}: architecture {architectures or '(none)'} needs the repository's own Python code "
            f"(auto_map: {', '.join(classes)}); {flag}Trillium never runs remote code. "
            f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if trust_remote_code and "auto_map" in config:
        log.info("--trust-remote-code: %s names remote code (auto_map) but its architecture %s is built in; "
                 "the built-in implementation is used and no remote code runs", path, architectures)
