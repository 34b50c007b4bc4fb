"""GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 weights kept packed give the dequantized model's results.

Synthetic checkpoints written as llama.cpp would quantize them (gguf-py's
quantizers through trillium/models/gguf_writer.py), loaded twice: packed (the
default on CPU float32) and with `gguf_dequantize=True` (the float path,
which matches transformers: test_models_gguf_synthetic.py). vLLM treats a
.gguf file as `--quantization gguf` (vllm-project/vllm
vllm/model_executor/layers/quantization/gguf.py `GGUFConfig`, Q4_0/Q4_1/Q8_0
among its STANDARD_QUANT_TYPES); so does EngineConfig here.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from trillium.models.gguf_writer import write_gguf
from support.paged_runner import max_abs_diff, random_sequences, run_schedule
from trillium.actors.executor.weights import WeightValidator
from trillium.actors.protocol.admin import ControlError
from trillium.config import EngineConfig
from trillium.kernels import gguf_cpu
from trillium.models import load_model
from trillium.models.loader import reload_weights
from trillium.models.packed_linear import GgufLinear

pytestmark = pytest.mark.skipif(not gguf_cpu.available(), reason="no C compiler for the packed kernel")


def llama_cpp_mix(name: str) -> Q | None:
    """Q4_1 projections, Q4_0 down_proj, Q5_0 / Q5_1 o_proj (layer 0 / 1), Q8_0 embedding/head and,
    in layer 1, a Q8_0 attn_v: that layer's fused qkv mixes formats and must fall back to float."""
    if name.startswith(("token_embd", "output.")):
        return Q.Q8_0
    if name.endswith(".attn_output.weight"):
        return Q.Q5_0 if name.startswith("blk.0.") else Q.Q5_1
    if name == "blk.1.attn_v.weight":
        return Q.Q8_0
    return Q.Q4_0 if ".ffn_down." in name else Q.Q4_1


def greedy(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy continuations: prompts prefilled in one step, then one token per sequence per step
    (the packed kernel's decode path), recomputed from scratch for each new token."""
    seqs = [list(p) for p in prompts]
    for step in range(num_tokens):
        schedule = (tuple((i, len(p)) for i, p in enumerate(prompts)),) + tuple(
            tuple((i, 1) for i in range(len(prompts))) for _ in range(step)
        )
        logits = run_schedule(model, seqs, schedule=schedule, block_size=4, num_blocks=64)
        for seq, rows in zip(seqs, logits):
            seq.append(int(rows[-1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    def get(variant: str):
        path = tmp_path_factory.mktemp(f"q-{variant}") / "model.gguf"
        return write_gguf(checkpoint(variant), path, quantize=llama_cpp_mix)

    return get


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2", "llama", "gemma2"])
def test_packed_matches_dequantized(quantized, variant, caplog):
    """With float32 activations (exact). Tied head (a packed copy of the Q8_0 embedding), qkv bias (qwen2), permuted Q/K rows and an
    untied Q8_0 head (llama), Gemma 2's soft-capped logits over the packed head; layer 1's
    mixed-format qkv is dequantized and the log says so."""
    path = quantized(variant)
    with caplog.at_level("INFO", logger="trillium.models.loader"):
        packed, config = load_model(path, progress=False, gguf_activations="float32")
    floats, _ = load_model(path, progress=False, gguf_dequantize=True)
    kinds = {name: m.format_name for name, m in packed.named_modules() if isinstance(m, GgufLinear)}
    assert kinds["lm_head"] == "Q8_0" and kinds["model.layers.0.self_attn.qkv_proj"] == "Q4_1"
    assert kinds["model.layers.0.mlp.down_proj"] == "Q4_0" and kinds["model.layers.1.mlp.gate_up_proj"] == "Q4_1"
    assert kinds["model.layers.0.self_attn.o_proj"] == "Q5_0" and kinds["model.layers.1.self_attn.o_proj"] == "Q5_1"
    assert "model.layers.1.self_attn.qkv_proj" not in kinds  # mixed Q4_1 / Q8_0: float
    assert not any(isinstance(m, GgufLinear) for m in floats.modules())
    summary = next(r.getMessage() for r in caplog.records if "kept packed" in r.getMessage())
    assert f"{len(kinds)} projections" in summary and "mixed formats in one fused projection" in summary
    if config.tie_word_embeddings:
        assert packed.lm_head_weight is packed.model.embed_tokens.weight  # the float embedding stays
    sequences = random_sequences(config.vocab_size, seed=3)
    assert max_abs_diff(run_schedule(packed, sequences), run_schedule(floats, sequences)) < 1e-4
    prompts = [s[:6] for s in sequences]
    assert greedy(packed, prompts, 10) == greedy(floats, prompts, 10)


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2"])
def test_int8_activations_stay_near_the_float_model(quantized, variant, caplog):
    """The default (`gguf_activations="int8"`, llama.cpp's numerics): every packed Q8_0 / Q4_x / Q5_x
    projection says int8, decode-sized batches' logits stay within a small fraction of the float
    model's spread (the kernel itself is checked exactly against its reference in
    tests/kernels/test_gguf_cpu_kernel.py), and its top-1 agrees at nearly every position."""
    path = quantized(variant)
    with caplog.at_level("INFO", logger="trillium.models.loader"):
        packed, config = load_model(path, progress=False)
    floats, _ = load_model(path, progress=False, gguf_dequantize=True)
    modes = {m.activations for m in packed.modules() if isinstance(m, GgufLinear)}
    assert modes == {"int8"}
    summary = next(r.getMessage() for r in caplog.records if "kept packed" in r.getMessage())
    assert "activations int8 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)" in summary
    assert ("; int8 fused pass up to 8 rows, GEMM above (AVX-512 VNNI)" if gguf_cpu.gemm_int8_vectorized()
            else "no int8 GEMM here") in summary
    sequences = random_sequences(config.vocab_size, seed=3)
    schedule = (tuple((i, 2) for i in range(len(sequences))),) + tuple(  # decode-sized steps throughout
        tuple((i, 1) for i in range(len(sequences))) for _ in range(4))
    ours = run_schedule(packed, [s[:6] for s in sequences], schedule=schedule, block_size=4, num_blocks=64)
    ref = run_schedule(floats, [s[:6] for s in sequences], schedule=schedule, block_size=4, num_blocks=64)
    spread = max(float(r.std()) for r in ref)
    assert 1e-4 < max_abs_diff(ours, ref) < 0.2 * spread  # not the float path, and near it
    agree = [bool((a.argmax(-1) == b.argmax(-1)).all()) for a, b in zip(ours, ref)]
    assert sum(agree) >= len(agree) - 1


def test_float_updates_refused_and_reload_refills_blocks(quantized):
    path = quantized("llama-tied")
    model, _ = load_model(path, progress=False)
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    with pytest.raises(ValueError, match="kept packed \\(Q4_1\\).*--gguf-dequantize"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))])
    validator = WeightValidator(model)  # the executor's check before any live update copies a byte
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):  # the head's source
        with pytest.raises(ControlError, match="packed \\((Q4_1|Q8_0), GGUF\\).*--gguf-dequantize"):
            validator.check([(name, torch.zeros(1))])
    assert validator.check([("model.layers.1.self_attn.q_proj.weight", torch.zeros(64, 64))])  # float there
    before = qkv.blocks.clone()
    qkv.blocks.zero_()
    reload_weights(model, path, progress=False)  # a GGUF of the same formats refills the blocks
    assert torch.equal(qkv.blocks, before) and model.get_submodule("model.layers.0.self_attn.qkv_proj") is qkv


def test_other_dtypes_dequantize(quantized):
    model, config = load_model(quantized("llama-tied"), dtype="bfloat16", progress=False)
    assert config.dtype == "bfloat16" and not any(isinstance(m, GgufLinear) for m in model.modules())


def test_quantization_names(quantized, checkpoint):
    with pytest.raises(ValueError, match="--quantization fp8: not supported.*gguf.*awq and gptq"):
        EngineConfig(model="m", quantization="fp8")
    assert EngineConfig(model=str(quantized("llama-tied")), quantization="gguf").resolve().quantization == "gguf"
    with pytest.raises(ValueError, match="--quantization gguf: .* is not a .gguf file"):
        EngineConfig(model=str(checkpoint("llama-tied")), quantization="gguf").resolve()


def test_serve_flags_reach_the_engine_config():
    """`--quantization gguf` passes the serve checks (vLLM's name); `--gguf-dequantize` reaches EngineConfig."""
    from trillium.cli import _engine_kwargs, build_parser, serve_parser
    from trillium.cli_compat import check_serve_args, expand_config_file

    parser = build_parser()
    args = parser.parse_args(expand_config_file(["serve", "m.gguf", "--quantization", "gguf", "--gguf-dequantize"],
                                                serve_parser(parser)))
    check_serve_args(args)
    kwargs = _engine_kwargs(args)
    assert kwargs["quantization"] == "gguf" and kwargs["gguf_dequantize"] is True
    assert EngineConfig.build(model="m.gguf", **kwargs).gguf_dequantize
    args = parser.parse_args(["serve", "m.gguf", "--gguf-activations", "float32"])
    assert _engine_kwargs(args)["gguf_activations"] == "float32"
    assert parser.parse_args(["serve", "m.gguf"]).gguf_activations is None  # int8 at load


def test_gguf_activations_refused_where_nothing_is_packed(quantized, checkpoint):
    """No silent no-op: --gguf-activations for a float checkpoint, or beside --gguf-dequantize, is an error;
    an unknown value too."""
    with pytest.raises(ValueError, match="--gguf-activations int8: applies to .gguf models"):
        EngineConfig(model=str(checkpoint("llama-tied")), gguf_activations="int8").resolve()
    with pytest.raises(ValueError, match="--gguf-activations float32 with --gguf-dequantize"):
        EngineConfig(model=str(quantized("llama-tied")), gguf_activations="float32", gguf_dequantize=True).resolve()
    with pytest.raises(ValueError, match="--gguf-activations 'int4': choose int8 or float32"):
        EngineConfig(model="m.gguf", gguf_activations="int4")
    assert EngineConfig(model=str(quantized("llama-tied")), gguf_activations="float32").resolve()


def q4_k_m_mix(name: str) -> Q | None:
    """A Q4_K_M-style file (ggml-org/llama.cpp src/llama-quant.cpp `llama_tensor_get_type_impl`): Q4_K
    projections; Q6_K for the tied embedding/head and, in a "more bits" layer (layer 0), for ffn_down and attn_v
    -- so layer 0's fused qkv mixes Q4_K / Q6_K and falls back to float; Q5_K gate/up in layer 1."""
    if name.startswith("token_embd") or name in ("blk.0.ffn_down.weight", "blk.0.attn_v.weight"):
        return Q.Q6_K
    return Q.Q5_K if name.startswith(("blk.1.ffn_gate", "blk.1.ffn_up")) else Q.Q4_K


def test_kquants_packed_match_dequantized(checkpoint, tmp_path):
    """Q4_K / Q5_K / Q6_K projections (K = 256: one super-block per row) load packed and give the
    dequantized model's logits and greedy tokens."""
    hf = checkpoint("llama-tied", hidden_size=256, intermediate_size=256, head_dim=64)
    path = write_gguf(hf, tmp_path / "model.gguf", quantize=q4_k_m_mix)
    packed, config = load_model(path, progress=False)
    floats, _ = load_model(path, progress=False, gguf_dequantize=True)
    kinds = {name: m.format_name for name, m in packed.named_modules() if isinstance(m, GgufLinear)}
    assert kinds == {"lm_head": "Q6_K", "model.layers.0.self_attn.o_proj": "Q4_K",
                     "model.layers.0.mlp.gate_up_proj": "Q4_K", "model.layers.0.mlp.down_proj": "Q6_K",
                     "model.layers.1.self_attn.qkv_proj": "Q4_K", "model.layers.1.self_attn.o_proj": "Q4_K",
                     "model.layers.1.mlp.gate_up_proj": "Q5_K", "model.layers.1.mlp.down_proj": "Q4_K"}  # fmt: skip
    sequences = random_sequences(config.vocab_size, seed=4)
    assert max_abs_diff(run_schedule(packed, sequences), run_schedule(floats, sequences)) < 1e-4
    prompts = [s[:6] for s in sequences]
    assert greedy(packed, prompts, 8) == greedy(floats, prompts, 8)
