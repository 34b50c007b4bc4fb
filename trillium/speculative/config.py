"""`SpeculativeConfig`: vLLM's `--speculative-config` / `LLM(speculative_config=...)`.

Parsed once at start-up (`parse_speculative_config`) from a dict, a JSON
string or None; an unknown key or method is a start-up error naming it.
Frozen, part of `EngineConfig`, so every actor sees the same one.

Keys per method (vllm/config/speculative.py SpeculativeConfig): ngram takes
prompt_lookup_min/max; draft_model takes model (the draft's path; vLLM's
default method when model is given without one), draft_tensor_parallel_size
(1 only), draft_sample_method ("greedy" only: drafts are point masses,
speculative/draft_model.py) and token_map. `num_draft_blocks` is resolved at start-up
(EngineConfig.resolve -> draft_model.plan_draft_memory), never given.

token_map (draft_model only; SGLang's --speculative-token-map, FR-Spec): a JSON
file holding a list of token ids, the draft's "hot" vocabulary. The draft's LM
head is cut to those rows, so each draft position reads a fraction of it, and
drafts are the argmax among them. Verification is unchanged, so the output is
exactly the target's whatever the map holds; a token outside it is never drafted
(it costs acceptance, never correctness). No pickle: SGLang's .pt maps are not
read. bench/build_draft_model.py --token-map N writes one from the target's own
outputs. Read and checked here, at start-up (ids unique, at least one, at most
MAX_TOKEN_MAP); against the draft's vocabulary in plan_draft_memory.

Every method takes disable_by_batch_size (vLLM's; its v0 spec_decode_worker's rule):
a step planned with more running requests than this verifies no drafts, and
the executor proposes none for it (speculative/scheduling.py). None or absent:
never disabled.
"""

from __future__ import annotations

import json

import attrs

# Methods Trillium implements; vLLM's other names are refused by name.
METHODS = ("ngram", "eagle", "draft_model")
_NOT_IMPLEMENTED = ("eagle3", "medusa", "mlp_speculator", "mtp", "suffix", "deepseek_mtp", "ngram_gpu")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "draft_tensor_parallel_size", "draft_sample_method", "disable_by_batch_size", "token_map")
# Keys that only some methods read: given to another method, they are refused by name.
_METHOD_KEYS = {"prompt_lookup_min": ("ngram",), "prompt_lookup_max": ("ngram",), "model": ("eagle", "draft_model"),
                "draft_tensor_parallel_size": ("draft_model",), "draft_sample_method": ("draft_model",),
                "token_map": ("draft_model",)}
# The deepest draft a step verifies (bounds the per-position loop of verify.py).
MAX_SPECULATIVE_TOKENS = 16
# The most ids a token_map may hold, and its file's size bound (read at start-up).
MAX_TOKEN_MAP = 1 << 20
_MAX_TOKEN_MAP_BYTES = 16 << 20


@attrs.frozen
class SpeculativeConfig:
    method: str = ""  # "" = speculative decoding off
    num_speculative_tokens: int = 0  # k: the most drafts proposed per request per step
    prompt_lookup_min: int = 0  # ngram: shortest suffix n-gram matched (resolved: vLLM's defaults)
    prompt_lookup_max: int = 0  # ngram: longest suffix n-gram matched
    model: str = ""  # eagle: the EAGLE head's directory (eagle_checkpoint.py); draft_model: the draft checkpoint
    num_draft_blocks: int = 0  # draft_model, resolved: blocks of the draft's own paged KV cache
    disable_by_batch_size: int = 0  # >= 2: no drafts in a step with more running requests; 0: never off
    token_map: str = ""  # draft_model: the hot-vocabulary file given, "" for the whole vocabulary
    token_map_ids: tuple[int, ...] = attrs.field(default=(), repr=False)  # its ids, read at start-up

    @property
    def enabled(self) -> bool:
        return bool(self.method)


NO_SPECULATION = SpeculativeConfig()


def parse_speculative_config(value) -> SpeculativeConfig:
    """From None / "" (off), a SpeculativeConfig, a dict or its JSON text. ValueError names the problem."""
    if value is None or value == "" or value == {}:
        return NO_SPECULATION
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unsupported key(s) {', '.join(unknown)}; "
                         f"Trillium implements {', '.join(_KEYS)}")
    method = value.get("method")
    if method is None and value.get("model") not in (None, "ngram", "[ngram]"):
        method = "draft_model"  # vLLM's default when a model is given without a method
    if method in ("[ngram]",):
        method = "ngram"
    if method in _NOT_IMPLEMENTED:
        raise ValueError(f"--speculative-config method {method!r} is not implemented; use one of {list(METHODS)}")
    if method not in METHODS:
        raise ValueError(f"--speculative-config method must be one of {list(METHODS)}, got {method!r}")
    misplaced = sorted(key for key, methods in _METHOD_KEYS.items() if key in value and method not in methods)
    if misplaced:
        raise ValueError(f"--speculative-config: {', '.join(misplaced)} not supported with method {method!r}")
    k = _int(value, "num_speculative_tokens", None)
    if k is None:
        raise ValueError("--speculative-config needs num_speculative_tokens")
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--speculative-config num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
    disable_by_batch_size = _disable_by_batch_size(value)
    return attrs.evolve(_by_method(method, value, k), disable_by_batch_size=disable_by_batch_size)


def _by_method(method: str, value: dict, k: int) -> SpeculativeConfig:
    if method == "eagle":
        return _eagle(value, k)
    if method == "draft_model":
        return _draft_model(value, k)
    lo, hi = _int(value, "prompt_lookup_min", None), _int(value, "prompt_lookup_max", None)
    # vLLM's defaults (vllm/config/speculative.py): both 5 when neither is given, else the given one.
    if lo is None and hi is None:
        lo = hi = 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo < 1 or hi < lo:
        raise ValueError(f"--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)


def draft_kv_block_bytes(config: SpeculativeConfig, target, block_size: int, dtype: str) -> int:
    """Bytes a proposer's own KV adds per target KV block (counted in the KV budget),
    after checking the draft against the target (`target`: its ModelConfig)."""
    if config.method != "eagle":
        return 0
    from trillium.models.config import torch_dtype
    from trillium.speculative import eagle_checkpoint

    head = eagle_checkpoint.read_config(config.model)
    eagle_checkpoint.check_against_target(head, target, config.model)
    # NOTE: a request's head cache holds its computed tokens plus its drafts, in block-size
    # chunks (eagle.py): its own blocks' worth, give or take one block per request.
    return block_size * eagle_checkpoint.kv_bytes_per_token(head, torch_dtype(dtype))


def _eagle(value: dict, k: int) -> SpeculativeConfig:
    """method eagle: the head's checkpoint directory, its format checked now (start-up)."""
    from trillium.speculative.eagle_checkpoint import read_config

    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("--speculative-config method 'eagle' needs model: the EAGLE head's checkpoint directory")
    read_config(model)  # EAGLE-3, a foreign architecture, HASS norms: refused by name
    return SpeculativeConfig(method="eagle", num_speculative_tokens=k, model=model)


def _draft_model(value: dict, k: int) -> SpeculativeConfig:
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("--speculative-config method 'draft_model' needs model (the draft checkpoint's path)")
    if _int(value, "draft_tensor_parallel_size", 1) != 1:
        raise ValueError("--speculative-config draft_tensor_parallel_size: only 1 is supported")
    if value.get("draft_sample_method", "greedy") != "greedy":
        raise ValueError(f"--speculative-config draft_sample_method {value['draft_sample_method']!r} is not "
                         "implemented; Trillium drafts greedily ('greedy')")
    token_map = value.get("token_map")
    if token_map is None:
        return SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=model)
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=model, token_map=token_map,
                             token_map_ids=read_token_map(token_map))


def read_token_map(path) -> tuple[int, ...]:
    """The ids of a token_map file: a JSON list of distinct non-negative ints. ValueError names the problem."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"--speculative-config token_map must be a file path, got {path!r}")
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_TOKEN_MAP_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"--speculative-config token_map {path!r}: {exc.strerror or exc}") from None
    if len(raw) > _MAX_TOKEN_MAP_BYTES:
        raise ValueError(f"--speculative-config token_map {path!r} is larger than {_MAX_TOKEN_MAP_BYTES} bytes")
    try:
        ids = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--speculative-config token_map {path!r} is not JSON: {exc}") from None
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"--speculative-config token_map {path!r} must hold a non-empty JSON list of token ids")
    if len(ids) > MAX_TOKEN_MAP:
        raise ValueError(f"--speculative-config token_map {path!r} holds {len(ids)} ids, more than {MAX_TOKEN_MAP}")
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
    if bad is not None:
        raise ValueError(f"--speculative-config token_map {path!r}: {bad!r} is not a token id (a non-negative int)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"--speculative-config token_map {path!r} lists a token id more than once")
    return tuple(ids)


def _disable_by_batch_size(value: dict) -> int:
    """vLLM's disable_by_batch_size: an int of at least 2, as vLLM checks, or None / absent
    (never off; stored as 0)."""
    got = _int(value, "disable_by_batch_size", None)
    if got is None:
        return 0
    if got < 2:
        raise ValueError(f"--speculative-config disable_by_batch_size must be at least 2 (vLLM's rule) or null, "
                         f"got {got}")
    return got


def _int(value: dict, key: str, default):
    got = value.get(key, default)
    if got is None:
        return default
    if isinstance(got, bool) or not isinstance(got, int):
        raise ValueError(f"--speculative-config {key} must be an integer, got {got!r}")
    return got
