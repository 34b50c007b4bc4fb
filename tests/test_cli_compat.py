"""vLLM's and SGLang's command lines as `trillium serve` reads them (no server started here).

Mirrors vLLM's argument definitions: vllm-project/vllm vllm/engine/arg_utils.py
(`human_readable_int`, `human_readable_int_or_auto` for --max-model-len,
--tensor-parallel-size, --gpu-memory-utilization, --seed, --generation-config),
vllm/entrypoints/openai/cli_args.py (--served-model-name nargs="+",
--allowed-origins/--allowed-methods/--allowed-headers as JSON lists,
--allow-credentials, --response-role, --max-logprobs, --ssl-*), and the
--config YAML of vllm/utils/argparse_utils.py FlexibleArgumentParser (the
file's flags first, the command line overrides them). SGLang spellings from
sgl-project/sglang python/sglang/srt/server_args.py (--model-path, --tp /
--tp-size, --context-length, --mem-fraction-static, --random-seed,
--max-running-requests, --disable-radix-cache).
"""

from __future__ import annotations

import argparse
import json

import pytest

from trillium.cli import build_parser, main, serve_parser
from trillium.cli_compat import check_serve_args, expand_config_file, human_readable_int, model_len, serve_model
from trillium.config import EngineConfig, kv_cache_memory_default
from trillium.http_cors import CorsPolicy


def parse(*argv: str) -> argparse.Namespace:
    parser = build_parser()
    return parser.parse_args(expand_config_file(["serve", *argv], serve_parser(parser)))


@pytest.mark.parametrize("text, value", [
    ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("32k", 32000), ("32K", 32768),
    ("1m", 10**6), ("1M", 2**20), ("2g", 2 * 10**9), ("1G", 2**30), ("4096", 4096),
])
def test_human_readable_int_matches_vllm(text, value):
    assert human_readable_int(text) == value


def test_binary_suffix_refuses_decimals_and_garbage():
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean 1.5k"):
        human_readable_int("1.5K")
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int("lots")


def test_max_model_len_auto_and_minus_one():
    assert model_len("-1") == model_len("auto") == -1
    assert parse("m", "--max-model-len", "32k").max_model_len == 32000
    assert parse("m", "--context-length", "2K").max_model_len == 2048  # SGLang's spelling
    with pytest.raises(SystemExit):
        parse("m", "--max-model-len", "-5")


def test_positional_model_and_aliases():
    args = parse("org/name", "--tp", "1", "--mem-fraction-static", "0.8", "--random-seed", "7",
                 "--max-running-requests", "8", "--disable-radix-cache")
    assert serve_model(args) == "org/name"
    assert (args.tensor_parallel_size, args.gpu_memory_utilization, args.seed) == (1, 0.8, 7)
    assert args.max_num_seqs == 8 and args.enable_prefix_caching is False
    assert serve_model(parse("--model-path", "org/name")) == "org/name"
    assert serve_model(parse("org/name", "--model", "org/name")) == "org/name"  # same one twice is fine
    with pytest.raises(SystemExit, match="two models given"):
        serve_model(parse("org/a", "--model", "org/b"))


def test_several_served_model_names():
    assert parse("m", "--served-model-name", "a", "b", "c").served_model_name == ["a", "b", "c"]


def test_config_yaml_then_command_line_overrides(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("model: org/from-yaml\nmax_model_len: 1k\nserved-model-name: [x, y]\nport: 9000\n"
                    "enable_prefix_caching: false\noverride_generation_config: {temperature: 0.5}\n"
                    "enable_sleep_mode: false\ntrust_remote_code: true\n")
    args = parse("--config", str(path), "--port", "9001")
    assert serve_model(args) == "org/from-yaml"
    assert (args.max_model_len, args.served_model_name, args.port) == (1000, ["x", "y"], 9001)
    assert args.enable_prefix_caching is False and args.enable_sleep_mode is False and args.trust_remote_code
    assert args.override_generation_config == {"temperature": 0.5}
    # A positional MODEL on the command line wins over the file's model.
    assert serve_model(parse("org/cli", "--config", str(path))) == "org/cli"


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(SystemExit, match="mapping"):
        expand_config_file(["serve", "--config", str(bad)])
    with pytest.raises(SystemExit, match="cannot read"):
        expand_config_file(["serve", "--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("argv, message", [
    (["-pp", "2"], "--pipeline-parallel-size 2"),
    (["--dp-size", "0"], "--data-parallel-size 0: must be >= 1"),
    (["--quantization", "fp8"], "--quantization fp8: .*awq, gptq.*--kv-cache-dtype fp8"),
    (["--load-format", "pt"], "never pickle"),
    (["--swap-space", "4"], "--kv-host-bytes"),
    (["--no-enable-chunked-prefill"], "always prefills in chunks"),
    (["--max-logprobs", "50"], "at most 20"),
    (["--ssl-keyfile", "k.pem"], "go together"),
])
def test_unsupported_flags_say_what_trillium_does(argv, message):
    with pytest.raises(SystemExit, match=message):
        check_serve_args(parse("m", *argv))


def test_data_parallel_replicas_of_a_tensor_parallel_engine_are_accepted():
    """vLLM's `--data-parallel-size 2 --tensor-parallel-size 2` (tests/data_parallel: the replicas' ranks)."""
    args = parse("m", "--dp", "2", "--tp", "2")
    check_serve_args(args)
    assert (args.data_parallel_size, args.tensor_parallel_size) == (2, 2)


def test_accepted_flags_pass_the_checks(caplog):
    args = parse("m", "--enable-sleep-mode", "--enforce-eager", "--enable-chunked-prefill", "--disable-log-stats",
                 "--disable-log-requests", "--trust-remote-code", "--enable-prompt-tokens-details",
                 "--tensor-parallel-size", "1", "--load-format", "safetensors", "--uvicorn-log-level", "warning")
    with caplog.at_level("INFO", logger="trillium.cli"):
        check_serve_args(args)
    assert "sleep / wake_up are always on the admin API" in caplog.text
    assert "no remote code is ever run" in caplog.text


def test_serve_exits_before_loading_on_a_refused_flag(tmp_path):
    with pytest.raises(SystemExit, match="--pipeline-parallel-size 2"):
        main(["serve", str(tmp_path), "--pipeline-parallel-size", "2"])


def test_tensor_parallel_aliases_reach_the_engine_and_refusals_name_the_feature(tmp_path):
    """vLLM's -tp / --tensor-parallel-size and SGLang's --tp / --tp-size (sgl-project/sglang,
    python/sglang/srt/server_args.py: `--tensor-parallel-size`, `--tp-size`) are one flag; what does
    not run under TP is refused at start naming it (distributed/tp_checks.py)."""
    for flag in ("-tp", "--tp", "--tp-size", "--tensor-parallel-size"):
        args = parse("m", flag, "2")
        check_serve_args(args)
        assert args.tensor_parallel_size == 2
    with pytest.raises(SystemExit, match="--tensor-parallel-size 2: not supported together with --runner pooling"):
        main(["serve", str(tmp_path), "--tp", "2", "--runner", "pooling"])


def test_gpu_memory_utilization_is_cuda_only():
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        EngineConfig(model="m", device="cpu", gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        EngineConfig(model="m", device="cuda", gpu_memory_utilization=1.5)


def test_vllm_cpu_kvcache_space_sizes_the_cpu_kv_cache():
    assert kv_cache_memory_default("cpu", {"VLLM_CPU_KVCACHE_SPACE": "2"}) == f"{2 * 2**30}B"
    assert kv_cache_memory_default("cpu", {}) == "512MiB"
    assert kv_cache_memory_default("cuda", {"VLLM_CPU_KVCACHE_SPACE": "2"}) == "512MiB"
    with pytest.raises(ValueError, match="GiB"):
        kv_cache_memory_default("cpu", {"VLLM_CPU_KVCACHE_SPACE": "lots"})
    args = parse("m")
    assert args.kv_cache_memory is None  # so the environment can fill it (cli._engine_kwargs)


def test_max_model_len_minus_one_is_what_the_kv_cache_holds(checkpoint):
    path = str(checkpoint("llama"))  # max_position_embeddings 256
    small = EngineConfig(model=path, max_model_len=-1, kv_cache_memory="64KiB", block_size=16).resolve()
    assert small.max_model_len == small.num_kv_tokens < 256
    large = EngineConfig(model=path, max_model_len=-1, kv_cache_memory="64MiB").resolve()
    assert large.max_model_len == 256


def test_cors_policy_preflight_and_simple_headers():
    policy = CorsPolicy(["https://app.example"], ["GET", "POST"], ["authorization", "content-type"], True)
    status, headers, _ = policy.preflight("https://app.example", "POST", "Authorization, Content-Type")
    names = dict(headers)
    assert status == 200 and names[b"access-control-allow-origin"] == b"https://app.example"
    assert names[b"access-control-allow-credentials"] == b"true"
    assert policy.preflight("https://evil.example", "POST", "")[0] == 400
    assert policy.preflight("https://app.example", "DELETE", "")[0] == 400
    assert policy.preflight("https://app.example", "POST", "x-custom")[0] == 400
    anyone = CorsPolicy()
    assert dict(anyone.simple_headers("https://a.example"))[b"access-control-allow-origin"] == b"*"
    with pytest.raises(ValueError):
        CorsPolicy(json.loads('{"not": "a list"}'))


def test_gpu_memory_utilization_counts_the_checkpoints_weights(checkpoint):
    """The weight bytes subtracted from --gpu-memory-utilization's share: every tensor of the checkpoint
    (CPU-checkable part of trillium/gpu_memory.py; the CUDA sizing itself needs a device)."""
    from safetensors import safe_open

    from trillium.gpu_memory import activation_reserve_bytes, checkpoint_numel
    from trillium.models.loader import load_model_config

    path = checkpoint("qwen2", sharded=True)
    expected = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            expected += sum(f.get_tensor(name).numel() for name in f.keys())
    assert checkpoint_numel(str(path)) == expected
    config = EngineConfig(model=str(path), max_num_batched_tokens=256, max_num_seqs=4)
    reserve = activation_reserve_bytes(config, load_model_config(path), "bfloat16")
    assert reserve > 512 * 2**20


def test_a_remote_code_model_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["FancyForCausalLM"], "auto_map": {"AutoModelForCausalLM": "modeling_fancy.FancyLM"}}))
    with pytest.raises(SystemExit, match="never runs remote code"):
        main(["serve", str(tmp_path), "--trust-remote-code"])


def test_an_unsupported_architecture_fails_at_start_naming_it(tmp_path, checkpoint, caplog):
    config = json.loads((checkpoint("llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"],
                                                      "model_type": "falcon"}))
    with caplog.at_level("ERROR", logger="trillium.serve"):
        assert main(["serve", str(tmp_path), "--admin-port", "0"]) == 2
    assert "FalconForCausalLM" in caplog.text and "LlamaForCausalLM" in caplog.text


def test_http_flags_become_server_settings():
    import logging

    from trillium.cli import _compat_server_kwargs

    args = parse("m", "--allowed-origins", '["https://a.example"]', "--allow-credentials",
                 "--uvicorn-log-level", "warning", "--response-role", "bot", "--enable-log-requests",
                 "--max-logprobs", "5")
    previous = logging.getLogger("hypercorn").level
    try:
        kwargs = _compat_server_kwargs(args, ("first", "second"))
        assert logging.getLogger("hypercorn").level == logging.WARNING
    finally:
        logging.getLogger("hypercorn").setLevel(previous)
    assert kwargs["cors"] == CorsPolicy(["https://a.example"], ["*"], ["*"], True)
    assert (kwargs["extra_model_names"], kwargs["response_role"], kwargs["max_logprobs"]) == (("second",), "bot", 5)
    assert kwargs["log_requests"] is True
    assert _compat_server_kwargs(parse("m"), ("m",))["cors"] is None  # CORS off unless asked for


def test_gpu_memory_utilization_on_cpu_exits_naming_the_cpu_flags(checkpoint):
    with pytest.raises(SystemExit, match="--kv-cache-memory .*VLLM_CPU_KVCACHE_SPACE"):
        main(["serve", str(checkpoint("llama")), "--gpu-memory-utilization", "0.5"])


def test_bad_generation_config_exits_at_start(checkpoint, tmp_path):
    path = str(checkpoint("llama"))
    with pytest.raises(SystemExit, match="auto, vllm or a folder"):
        main(["serve", path, "--generation-config", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit):
        main(["serve", path, "--override-generation-config", "[1, 2]"])


def test_enforce_eager_and_compile_batch_sizes_reach_the_engine_config(checkpoint, monkeypatch):
    """vLLM's --enforce-eager (vllm/engine/arg_utils.py) turns compiled decode off; without it the
    TRILLIUM_ENFORCE_EAGER switch decides (the suite sets 1), else it compiles."""
    from trillium.cli import _engine_kwargs

    model = str(checkpoint("llama"))

    def resolved(*argv: str, env: str | None) -> EngineConfig:
        if env is None:
            monkeypatch.delenv("TRILLIUM_ENFORCE_EAGER", raising=False)
        else:
            monkeypatch.setenv("TRILLIUM_ENFORCE_EAGER", env)
        return EngineConfig.build(model=model, **_engine_kwargs(parse(model, *argv))).resolve()

    assert resolved("--enforce-eager", env="0").enforce_eager is True
    assert resolved(env="1").enforce_eager is True
    compiled = resolved("--compile-batch-sizes", "1,16", env=None)
    assert (compiled.enforce_eager, compiled.compile_batch_sizes) == (False, (1, 16))
    assert EngineConfig.from_bytes(compiled.to_bytes()) == compiled
    with pytest.raises(SystemExit):
        parse(model, "--compile-batch-sizes", "0,4")
    # Unset: 1 .. 64, up to the first size that holds a full step of --max-num-seqs rows (a verify
    # step's drafts count); given: exactly what was asked, past --max-num-seqs too.
    assert resolved(env=None).compile_batch_sizes == (1, 2, 4, 8, 16, 32, 64)
    assert resolved("--max-num-seqs", "8", env=None).compile_batch_sizes == (1, 2, 4, 8)
    assert resolved("--max-num-seqs", "12", env=None).compile_batch_sizes == (1, 2, 4, 8, 16)
    assert resolved("--max-num-seqs", "4", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                    env=None).compile_batch_sizes == (1, 2, 4, 8, 16)
    assert resolved("--max-num-seqs", "8", "--compile-batch-sizes", "1,64", env=None).compile_batch_sizes == (1, 64)
    default = resolved("--max-num-seqs", "8", env=None)
    assert EngineConfig.from_bytes(default.to_bytes()) == default


def test_async_scheduling_flag_reaches_the_engine_and_falls_back_where_not_exact(checkpoint, caplog):
    """vLLM's --async-scheduling / --no-async-scheduling (vllm/engine/arg_utils.py, a
    BooleanOptionalAction over SchedulerConfig.async_scheduling, default None: on where supported).
    Trillium's None is on while at most ASYNC_AUTO_MAX_RUNNING requests run, and quietly off where
    not supported; asked for under speculative decoding it falls back to synchronous steps with a
    warning."""
    from trillium.actors.scheduler.config import SchedulerConfig
    from trillium.cli import _engine_kwargs
    from trillium.config import ASYNC_AUTO_MAX_RUNNING

    model = str(checkpoint("llama"))

    def resolved(*argv: str) -> EngineConfig:
        return EngineConfig.build(model=model, **_engine_kwargs(parse(model, *argv))).resolve()

    unset = resolved()
    assert (unset.async_scheduling, unset.async_max_running) == (True, ASYNC_AUTO_MAX_RUNNING)
    assert SchedulerConfig.from_engine(unset).async_max_running == ASYNC_AUTO_MAX_RUNNING
    assert resolved("--no-async-scheduling").async_scheduling is False
    on = resolved("--async-scheduling")
    assert (on.async_scheduling, on.async_max_running) == (True, 0)  # at any batch
    assert EngineConfig.from_bytes(on.to_bytes()) == on
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    assert resolved("--speculative-config", spec).async_scheduling is False
    assert "--async-scheduling is off" not in caplog.text  # unset: off without a warning
    assert resolved("--async-scheduling", "--speculative-config", spec).async_scheduling is False
    assert "--async-scheduling is off" in caplog.text and "--speculative-config" in caplog.text


def test_num_scheduler_steps_flag_reaches_the_scheduler(checkpoint):
    """vLLM's --num-scheduler-steps (vllm/engine/arg_utils.py EngineArgs.num_scheduler_steps, an int,
    default 1: its v0 multi-step scheduling); out of range or beside speculative decoding, an error."""
    from trillium.actors.scheduler.config import SchedulerConfig
    from trillium.cli import _engine_kwargs

    model = str(checkpoint("llama"))

    def resolved(*argv: str) -> EngineConfig:
        return EngineConfig.build(model=model, **_engine_kwargs(parse(model, *argv))).resolve()

    assert resolved().num_scheduler_steps == 1
    four = resolved("--num-scheduler-steps", "4")
    assert (four.num_scheduler_steps, four.async_scheduling) == (4, True)  # planned ahead (in_flight.py)
    assert SchedulerConfig.from_engine(four).num_scheduler_steps == 4
    assert EngineConfig.from_bytes(four.to_bytes()) == four
    with pytest.raises(ValueError, match="--num-scheduler-steps must be in 1..16"):
        resolved("--num-scheduler-steps", "0")
    with pytest.raises(ValueError, match="with --speculative-config"):
        resolved("--num-scheduler-steps", "2", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')


def test_stream_interval_flags_reach_the_scheduler_and_the_executor(checkpoint):
    """SGLang's --stream-interval (python/sglang/srt/server_args.py, an int, default 1; slime passes
    it to its rollout servers) and vLLM's stream_interval (v1/engine/output_processor.py); below 1,
    an error naming the flag."""
    from trillium.actors.scheduler.config import SchedulerConfig
    from trillium.cli import _engine_kwargs

    model = str(checkpoint("llama"))

    def resolved(*argv: str) -> EngineConfig:
        return EngineConfig.build(model=model, **_engine_kwargs(parse(model, *argv))).resolve()

    assert resolved().stream_interval == 1
    four = resolved("--stream-interval", "4")
    assert SchedulerConfig.from_engine(four).stream_interval == 4
    assert EngineConfig.from_bytes(four.to_bytes()) == four  # what the executor gets
    for bad in ("0", "1025"):  # bounded: a chunk's tokens travel as one message
        with pytest.raises(ValueError, match=r"--stream-interval must be in \[1, 1024\]"):
            resolved("--stream-interval", bad)
    # vLLM v0's --multi-step-stream-outputs (vllm/engine/arg_utils.py, default True).
    assert resolved().multi_step_stream_outputs is True
    assert resolved("--num-scheduler-steps", "4", "--no-multi-step-stream-outputs").multi_step_stream_outputs is False


def test_compile_cpp_wrapper_max_batch_flag_reaches_the_executor(checkpoint):
    """--compile-cpp-wrapper-max-batch (ours: compiled buckets up to N through Inductor's C++ wrapper,
    executor/compiled_decode.py); negative, an error naming the flag."""
    from trillium.cli import _engine_kwargs

    model = str(checkpoint("llama"))

    def resolved(*argv: str) -> EngineConfig:
        return EngineConfig.build(model=model, **_engine_kwargs(parse(model, *argv))).resolve()

    assert resolved().compile_cpp_wrapper_max_batch == 4
    none = resolved("--compile-cpp-wrapper-max-batch", "0")
    assert none.compile_cpp_wrapper_max_batch == 0
    assert EngineConfig.from_bytes(none.to_bytes()) == none  # what the executor gets
    with pytest.raises(ValueError, match="--compile-cpp-wrapper-max-batch must be >= 0"):
        resolved("--compile-cpp-wrapper-max-batch", "-1")
