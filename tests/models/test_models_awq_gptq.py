"""AWQ and GPTQ 4-bit checkpoints load kept packed and give the dequantized float model's results.

A tiny qwen2-shaped model (qkv bias; in_features 128 / 256, multiples of the group size 128) is
quantized per group of 128 inputs and packed by tests/support/int4_writer.py the way AutoAWQ
(casper-hansen/AutoAWQ awq/modules/linear/gemm.py) and AutoGPTQ (AutoGPTQ/AutoGPTQ
auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py; v1 zeros stored - 1) write them, with the
`quantization_config` they put in config.json. The reference is the same model with the dequantized
float weights, computed the way vLLM reads the tensors (vllm-project/vllm
vllm/model_executor/layers/quantization/awq_triton.py, csrc/quantization/gptq/q_gemm.cu). vLLM
detects the method from `quant_method` and refuses a different `--quantization` (ModelConfig
`_verify_quantization`); EngineConfig does the same. transformers (5.24 here) cannot be the oracle:
loading these checkpoints raises ImportError ("Loading an AWQ quantized model requires gptqmodel",
"Loading a GPTQ quantized model requires optimum"), packages the venv does not have.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from support.int4_writer import write_int4_checkpoint
from support.paged_runner import max_abs_diff, random_sequences, run_schedule
from trillium.actors.executor.weights import WeightValidator
from trillium.actors.protocol.admin import ControlError
from trillium.config import EngineConfig
from trillium.kernels import int4_cpu
from trillium.models import load_model
from trillium.models.int4_linear import Int4Linear
from trillium.models.loader import reload_weights

pytestmark = pytest.mark.skipif(not int4_cpu.available(), reason="no C compiler for the int4 kernel")
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
FLAVOURS = {
    "awq": dict(method="awq"),
    "gptq-v1-sym": dict(method="gptq"),
    "gptq-v2-act-order": dict(method="gptq", v2=True, desc_act=True),
    "awq-partial": dict(method="awq", skip=("model.layers.1.self_attn.k_proj",)),
}


@pytest.fixture(scope="module")
def int4_checkpoint(checkpoint, tmp_path_factory):
    built = {}

    def get(flavour: str):
        if flavour not in built:
            args = dict(FLAVOURS[flavour])
            out = tmp_path_factory.mktemp("int4") / flavour
            built[flavour] = write_int4_checkpoint(checkpoint("qwen2", **SHAPE), out, args.pop("method"), **args)
        return built[flavour]

    return get


def greedy(model, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy continuations and their logprobs: prompts prefilled in one step (the prefill path), then
    one token per sequence per step (the kernel's decode path), recomputed from scratch each token."""
    seqs, logprobs = [list(p) for p in prompts], [[] for _ in prompts]
    for step in range(num_tokens):
        schedule = (tuple((i, len(p)) for i, p in enumerate(prompts)),) + tuple(
            tuple((i, 1) for i in range(len(prompts))) for _ in range(step)
        )
        logits = run_schedule(model, seqs, schedule=schedule, block_size=4, num_blocks=64)
        for seq, lp, rows in zip(seqs, logprobs, logits):
            token = int(rows[-1].argmax())
            seq.append(token)
            lp.append(float(torch.log_softmax(rows[-1].double(), -1)[token]))
    return [s[len(p):] for s, p in zip(seqs, prompts)], logprobs


@pytest.mark.parametrize("flavour", ["awq", "gptq-v1-sym", "gptq-v2-act-order"])
def test_packed_matches_dequantized_model(int4_checkpoint, flavour, caplog):
    path, reference = int4_checkpoint(flavour)
    with caplog.at_level("INFO", logger="trillium.models.int4_linear"):
        model, config = load_model(path, dtype="float32", progress=False)
    floats, _ = load_model(reference, dtype="float32", progress=False)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 4 * config.num_layers and "lm_head" not in layers  # the head stays float
    assert layers["model.layers.0.self_attn.qkv_proj"].bias is not None  # qwen2's float bias taken over
    assert (layers["model.layers.0.mlp.down_proj"].perm is not None) == flavour.endswith("act-order")
    assert any("kept packed: 8 projections" in r.getMessage() for r in caplog.records)
    sequences = random_sequences(config.vocab_size, seed=3)
    assert max_abs_diff(run_schedule(model, sequences), run_schedule(floats, sequences)) < 1e-4
    prompts = [s[:6] for s in sequences[:3]]
    tokens, logprobs = greedy(model, prompts, 6)
    ref_tokens, ref_logprobs = greedy(floats, prompts, 6)
    assert tokens == ref_tokens
    assert max(abs(a - b) for x, y in zip(logprobs, ref_logprobs) for a, b in zip(x, y)) < 1e-4


def test_engine_serves_the_packed_checkpoint(int4_checkpoint):
    """`trillium.LLM` (the real engine: EngineConfig.resolve, the executor's load) with vLLM's
    `quantization="gptq"` generates the reference model's greedy tokens and logprobs."""
    from trillium import LLM, SamplingParams

    path, reference = int4_checkpoint("gptq-v2-act-order")
    floats, config = load_model(reference, dtype="float32", progress=False)
    prompts = [s[:6] for s in random_sequences(config.vocab_size, seed=7)[:2]]
    ref_tokens, ref_logprobs = greedy(floats, prompts, 5)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    with LLM(str(path), quantization="gptq", max_num_batched_tokens=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, tokens, logprobs in zip(outs, ref_tokens, ref_logprobs):
        got = out.outputs[0]
        assert got.token_ids == tokens
        lps = [entry[token].logprob for entry, token in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, logprobs)) < 1e-3


def test_partly_quantized_projection_and_reload(int4_checkpoint, caplog):
    """AutoAWQ's modules_to_not_convert leaves a module in float: its fused qkv is dequantized (and
    logged); reload_weights refills the packed buffers in place; live float updates are refused."""
    path, reference = int4_checkpoint("awq-partial")
    with caplog.at_level("INFO", logger="trillium.models.int4_linear"):
        model, config = load_model(path, dtype="float32", progress=False)
    assert not isinstance(model.get_submodule("model.layers.1.self_attn.qkv_proj"), Int4Linear)
    assert "(only partly quantized): model.layers.1.self_attn.qkv_proj" in caplog.text
    floats, _ = load_model(reference, dtype="float32", progress=False)
    sequences = random_sequences(config.vocab_size, seed=5)
    assert max_abs_diff(run_schedule(model, sequences), run_schedule(floats, sequences)) < 1e-4
    layer = model.get_submodule("model.layers.0.mlp.gate_up_proj")
    before = layer.qs.clone()
    layer.qs.zero_()
    reload_weights(model, path, progress=False)
    assert torch.equal(layer.qs, before) and model.get_submodule("model.layers.0.mlp.gate_up_proj") is layer
    with pytest.raises(KeyError, match="q_proj.weight"):  # a float update has no parameter to land in
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(128, 128))])
    validator = WeightValidator(model)  # the executor's check before a live update copies a byte
    with pytest.raises(ControlError, match="keeps that projection at 4 bits \\(AWQ int4 g128\\).*float checkpoint"):
        validator.check([("model.layers.0.self_attn.q_proj.weight", torch.zeros(128, 128))])
    assert validator.check([("model.layers.1.self_attn.k_proj.weight", torch.zeros(64, 128))])  # float there


def test_other_dtypes_dequantize(int4_checkpoint):
    path, reference = int4_checkpoint("awq")
    model, config = load_model(path, dtype="bfloat16", progress=False)
    assert config.dtype == "bfloat16" and not any(isinstance(m, Int4Linear) for m in model.modules())
    floats, _ = load_model(reference, dtype="bfloat16", progress=False)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, floats.model.layers[0].mlp.down_proj.weight)


def _with_quant_config(src, dst, **changes):
    """A copy of `src`'s config.json (no weights: EngineConfig.resolve reads only the config)."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **changes}
    (dst / "config.json").write_text(json.dumps(config))
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return str(dst)


def test_quantization_flag_and_unsupported_checkpoints(int4_checkpoint, checkpoint, tmp_path):
    awq, float_dir = (str(p) for p in int4_checkpoint("awq"))
    gptq = str(int4_checkpoint("gptq-v1-sym")[0])
    assert EngineConfig(model=awq, quantization="awq").resolve().quantization == "awq"
    assert EngineConfig(model=gptq).resolve().quantization is None  # detected from config.json at load
    with pytest.raises(ValueError, match="--quantization gptq: .* has quant_method awq"):
        EngineConfig(model=awq, quantization="gptq").resolve()
    with pytest.raises(ValueError, match="--quantization awq: .* has no quantization_config"):
        EngineConfig(model=float_dir, quantization="awq").resolve()
    with pytest.raises(ValueError, match="--tensor-parallel-size 2: GPTQ checkpoints are not sharded"):
        EngineConfig(model=gptq, tensor_parallel_size=2).resolve()
    src = int4_checkpoint("awq")[0]
    for i, (changes, message) in enumerate([
        (dict(bits=8), "awq with bits=8: not supported; Trillium loads AWQ .* GPTQ .*4 bits"),
        (dict(group_size=100), "awq with group_size=100: not supported"),
        (dict(version="gemv"), "awq version 'gemv'"),
        (dict(quant_method="fp8"), "checkpoint quantization 'fp8': not supported"),
        (dict(quant_method="gptq", checkpoint_format="marlin"), "gptq checkpoint_format 'marlin'"),
        (dict(quant_method="gptq", is_marlin_format=True), "gptq checkpoint_format 'marlin'"),
        (dict(quant_method="gptq", dynamic={"-:.*down_proj": {}}), "per-module `dynamic` overrides"),
    ]):
        with pytest.raises(ValueError, match=message):
            EngineConfig(model=_with_quant_config(src, tmp_path / str(i), **changes)).resolve()


def test_serve_accepts_vllm_names():
    from trillium.cli import _engine_kwargs, build_parser, serve_parser
    from trillium.cli_compat import check_serve_args, expand_config_file

    parser = build_parser()
    for name in ("awq", "gptq"):
        args = parser.parse_args(expand_config_file(["serve", "m", "--quantization", name], serve_parser(parser)))
        check_serve_args(args)
        assert _engine_kwargs(args)["quantization"] == name
