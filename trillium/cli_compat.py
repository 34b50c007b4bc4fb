"""vLLM's and SGLang's command lines, read by `trillium serve`.

A `vllm serve MODEL ...` or `python -m sglang.launch_server --model-path
MODEL ...` line starts Trillium unchanged (the model swapped for a path or
a Hub id). This module holds what that needs beyond Trillium's own flags:

- `human_readable_int` / `model_len`: vLLM's integer syntax (`32k` = 32000,
  `32K` = 32768, `-1` / `auto`), vllm/engine/arg_utils.py.
- `expand_config_file(argv)`: vLLM's `--config config.yaml` (a mapping of
  flag names to values), spliced in before the command line's own flags so
  the command line wins (vllm/utils/argparse_utils.py FlexibleArgumentParser).
- `add_serve_args(parser)`: the accepted vLLM / SGLang flags that have no
  home in Trillium's own groups, and the refused ones, each with its help.
- `check_serve_args(args)`: the refusals (a flag whose vLLM meaning Trillium
  does not implement exits with a message saying what Trillium does
  instead: never a silent no-op) and the notes logged for flags whose
  meaning Trillium already has by construction.

No state; the parser holds the values.
"""

from __future__ import annotations

import argparse
import json
import logging
import re

log = logging.getLogger("trillium.cli")

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """vLLM's: '1k' -> 1000, '1K' -> 1024, '25.6k' -> 25600; decimals only with k/m/g/t."""
    text = str(value).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {value!r} (e.g. 4096, 32k, 32K)") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{value!r}: decimals are not allowed with binary suffixes like {suffix}; "
            f"did you mean {number}{suffix.lower()}?")
    return int(number) * _BINARY[suffix]


def model_len(value: str) -> int:
    """--max-model-len: a human-readable int, or -1 / auto (the longest context the KV cache holds)."""
    text = str(value).strip()
    if text == "-1" or text.lower() == "auto":
        return -1
    number = human_readable_int(text)
    if number < 0:
        raise argparse.ArgumentTypeError(f"--max-model-len {value!r}: must be positive, -1 or auto")
    return number


def json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


# -- --config config.yaml ------------------------------------------------------

def _config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --config path, argv without it)."""
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise SystemExit("--config needs a path to a YAML file")
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def _false_flag(flag: str, serve) -> list[str]:
    """`key: false`: --no-KEY for an on/off flag, nothing for a switch that is off by default."""
    action = None if serve is None else serve._option_string_actions.get(flag)  # noqa: SLF001
    if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001 - off already
        return []
    return ["--no-" + flag[2:]]


def _yaml_flags(path: str, serve=None) -> list[str]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"--config {path}: cannot read it as YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a mapping of flag names to values")
    flags: list[str] = []
    for key, value in data.items():
        # WHY a separate flag for the model: a positional MODEL on the command line
        # overrides the file's, and only two MODELs given on the command line conflict.
        flag = "--config-model" if key == "model" else "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags += _false_flag(flag, serve)
        elif isinstance(value, list):
            flags += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def expand_config_file(argv: list[str], serve=None) -> list[str]:
    """Splice `--config FILE`'s flags in right after the subcommand: later (command-line) flags win.
    `serve`: the serve subparser, to tell on/off flags from switches for `key: false`."""
    path, rest = _config_path(argv)
    if path is None:
        return argv
    if not rest or rest[0] != "serve":
        raise SystemExit("--config is read by `trillium serve` only")
    return [rest[0], *_yaml_flags(path, serve), *rest[1:]]


# -- flags ---------------------------------------------------------------------

def add_model_source_args(group) -> None:
    """Where the model, tokenizer and sampling defaults come from (serve and generate)."""
    group.add_argument("--revision", default=None,
                       help="Hub branch, tag or commit of MODEL when it is a Hub id (default: main)")
    group.add_argument("--download-dir", default=None,
                       help="Hugging Face cache directory for Hub models (default: HF_HUB_CACHE, "
                            "under HF_HOME); with HF_HUB_OFFLINE=1 only the cache is read")
    group.add_argument("--tokenizer", default=None,
                       help="tokenizer folder or Hub id (default: the model's)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM compatibility; Trillium never runs a model repository's "
                            "code: a model that needs it (auto_map, unknown architecture) is refused")
    group.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                       help="default sampling parameters (temperature, top_p, top_k, min_p, "
                            "repetition_penalty, max_new_tokens as max_tokens): auto, from the model's "
                            "generation_config.json; vllm, none (the API's neutral defaults); DIR, from "
                            "DIR/generation_config.json. A request's own values win")
    group.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                       help="JSON object of generation-config fields that override the loaded ones, "
                            "e.g. '{\"temperature\": 0.5}' (applies with --generation-config vllm too)")


def add_serve_args(serve) -> None:
    """vLLM / SGLang flags of `trillium serve` outside Trillium's own groups (see README's flag table)."""
    compat = serve.add_argument_group(
        "vLLM / SGLang compatibility (accepted with their meaning, or refused naming what Trillium does)")
    compat.add_argument("--seed", "--random-seed", type=int, default=0,
                        help="seed of the executor's random state: requests without their own seed "
                             "sample reproducibly for the same request order (vLLM's default 0)")
    compat.add_argument("--gpu-memory-utilization", "--mem-fraction-static", type=float, default=None,
                        help="CUDA: size the KV cache as this fraction of device memory minus the weights "
                             "and an activation reserve (instead of --kv-cache-memory). CPU: refused; use "
                             "--kv-cache-memory or VLLM_CPU_KVCACHE_SPACE (GiB)")
    compat.add_argument("--enable-sleep-mode", action="store_true",
                        help="accepted: sleep / wake_up are always available on the admin API (--admin-port)")
    compat.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="Trillium always prefills long prompts in chunks of --max-num-batched-tokens; "
                             "--no-enable-chunked-prefill is refused")
    compat.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly: no compiled decode graphs (see "
                             "--compile-batch-sizes; CUDA graphs are never used)")
    compat.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan step N+1 while step N runs, so the executor never waits for the "
                             "scheduler between steps (its inputs take the tokens it just sampled). "
                             "Unset (the default): on while at most 4 requests run, synchronous steps "
                             "above; --async-scheduling: at any batch; --no-async-scheduling: never. "
                             "Synchronous steps under --speculative-config, the host / disk KV tiers "
                             "and pooling models (a warning when it was asked for)")
    compat.add_argument("--num-scheduler-steps", type=int, default=1, metavar="K",
                        help="multi-step decode (vLLM v0's flag): while no request waits and every running "
                             "request decodes, a step runs up to K forwards on the executor, each feeding the "
                             "token just sampled, so the scheduler plans once per K tokens; the tokens "
                             "stream as the forwards sample them (see --stream-interval). Output is "
                             "unchanged; an abort or stop string takes effect after the step (and the "
                             "one planned behind it). 1 (the "
                             "default): one forward per step. With --async-scheduling the next step "
                             "is planned while one runs; not with --speculative-config")
    compat.add_argument("--multi-step-stream-outputs", action=argparse.BooleanOptionalAction, default=True,
                        help="vLLM v0's flag: with --num-scheduler-steps above 1, stream a step's tokens as "
                             "its forwards sample them (the default); --no-multi-step-stream-outputs sends "
                             "them together when the step ends (one chunk of up to K tokens)")
    compat.add_argument("--stream-interval", type=int, default=1, metavar="N",
                        help="SGLang's and vLLM's flag: a streamed response gets a chunk once N new "
                             "tokens wait (its first token and its last chunk at once), so the "
                             "detokenizer and the api handle one message per N tokens; larger is "
                             "faster for a few streams, smaller is smoother. With --num-scheduler-steps "
                             "K, a step's tokens stream every N of its forwards (N = K: once per "
                             "step). Text and tokens are unchanged; a stop string can take up to N "
                             "tokens to be seen. Default 1: every token as it comes; at most 1024. "
                             "Unstreamed responses hold their tokens for chunks of at least 50")
    compat.add_argument("--disable-log-requests", action="store_true",
                        help="accepted: Trillium does not log request contents")
    compat.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's id, prompt length and sampling parameters at info level")
    compat.add_argument("--disable-log-stats", action="store_true",
                        help="accepted: Trillium logs no periodic stats (they are on /metrics)")
    compat.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs / top_logprobs a request may ask for (at most 20)")
    compat.add_argument("--response-role", default="assistant",
                        help="role of chat replies when the request adds a generation prompt")
    compat.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="accepted: usage.prompt_tokens_details.cached_tokens is always reported")
    compat.add_argument("--uvicorn-log-level", default=None,
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="log level of the HTTP server (Hypercorn); trace also logs every access")
    compat.add_argument("--tensor-parallel-size", "-tp", "--tp", "--tp-size", type=int, default=1,
                        help="shard the model over N executor processes (Megatron-style; torch.distributed: "
                             "NCCL on cuda:0..N-1 from --device, gloo on CPU, the cores split between the "
                             "ranks); dense Llama-family safetensors checkpoints; --kv-cache-memory is per "
                             "rank. See README 'Tensor parallelism' for what is refused with it")
    compat.add_argument("--pipeline-parallel-size", "-pp", "--pp-size", type=int, default=1, help="only 1")
    compat.add_argument("--data-parallel-size", "-dp", "--dp", "--dp-size", type=int, default=1,
                        help="engine replicas behind this one API server (each its own scheduler, executor "
                             "and detokenizer; on CUDA replica i uses cuda:i; on CPU they split the cores); "
                             "requests go to the least-loaded replica unless another holds their prefix "
                             "(README \"Scaling out\")")
    compat.add_argument("--quantization", "-q", default=None,
                        help="weight quantization (vLLM's names): gguf, implied for a .gguf model "
                             "(Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K weights kept packed; see --gguf-dequantize); "
                             "awq or gptq, implied by a 4-bit AWQ/GPTQ checkpoint's config.json (kept at 4 bits on CPU float32); "
                             "others (fp8, bitsandbytes, ...) are refused; for a smaller KV cache use "
                             "--kv-cache-dtype fp8")
    compat.add_argument("--load-format", default="auto", help="auto or safetensors (never pickle)")
    compat.add_argument("--swap-space", type=float, default=None,
                        help="refused: use --kv-host-bytes with --preemption-mode swap")
    compat.add_argument("--disable-radix-cache", dest="enable_prefix_caching", action="store_false",
                        help="SGLang's spelling of --no-enable-prefix-caching")
    compat.add_argument("--config-model", default=None, help=argparse.SUPPRESS)  # `model:` of --config
    cors = serve.add_argument_group("CORS (vLLM's flags; off unless one is given)")
    cors.add_argument("--allowed-origins", type=json.loads, default=None, metavar="JSON",
                      help="JSON list of origins browsers may call from, e.g. '[\"*\"]'")
    cors.add_argument("--allowed-methods", type=json.loads, default=None, metavar="JSON",
                      help="JSON list of methods (default with CORS on: [\"*\"])")
    cors.add_argument("--allowed-headers", type=json.loads, default=None, metavar="JSON",
                      help="JSON list of request headers (default with CORS on: [\"*\"])")
    cors.add_argument("--allow-credentials", action="store_true", help="allow credentials (cookies)")
    tls = serve.add_argument_group("TLS (the data plane, --port)")
    tls.add_argument("--ssl-keyfile", default=None, help="PEM private key: serve HTTPS")
    tls.add_argument("--ssl-certfile", default=None, help="PEM certificate chain: serve HTTPS")


def serve_model(args) -> str | None:
    """MODEL from the positional, --model / --model-path, or --config's `model:`; two different ones exit."""
    given = [m for m in (args.model_tag, args.model) if m]
    if len(set(given)) > 1:
        raise SystemExit(f"two models given: positional {args.model_tag!r} and --model {args.model!r}; "
                         "give one")
    return given[0] if given else args.config_model


def check_serve_args(args) -> None:
    """Refuse what Trillium does not implement; log what it does by construction."""
    if args.pipeline_parallel_size != 1:
        raise SystemExit(f"--pipeline-parallel-size {args.pipeline_parallel_size}: Trillium has no pipeline "
                         "parallelism; use 1, with --tensor-parallel-size or --data-parallel-size")
    refusals = (
        (args.data_parallel_size < 1, f"--data-parallel-size {args.data_parallel_size}: must be >= 1"),
        (args.quantization not in (None, "gguf", "awq", "gptq"),
         f"--quantization {args.quantization}: not supported; Trillium loads float safetensors, GGUF "
         "(--quantization gguf) and 4-bit AWQ / GPTQ safetensors (awq, gptq); use --kv-cache-dtype fp8 for a "
         "smaller KV cache"),
        (args.load_format not in ("auto", "safetensors"),
         f"--load-format {args.load_format}: Trillium reads safetensors or GGUF only (auto), never pickle"),
        (args.swap_space is not None, "--swap-space: Trillium swaps preempted requests' KV to its host tier: "
                                      "give --kv-host-bytes (e.g. 4GiB) and --preemption-mode swap"),
        (not args.enable_chunked_prefill, "--no-enable-chunked-prefill: Trillium always prefills in chunks of "
                                          "--max-num-batched-tokens; set it >= --max-model-len to prefill "
                                          "every prompt in one step"),
        (not 0 <= args.max_logprobs <= 20, f"--max-logprobs {args.max_logprobs}: Trillium returns at most 20"),
        (bool(args.ssl_keyfile) != bool(args.ssl_certfile), "--ssl-keyfile and --ssl-certfile go together"),
    )
    for refused, message in refusals:
        if refused:
            raise SystemExit(message)
    notes = ((args.enable_sleep_mode, "--enable-sleep-mode: sleep / wake_up are always on the admin API"),
             (args.disable_log_stats, "--disable-log-stats: Trillium logs no periodic stats (see /metrics)"),
             (args.trust_remote_code, "--trust-remote-code: accepted; no remote code is ever run"))
    for given, note in notes:
        if given:
            log.info("%s", note)
