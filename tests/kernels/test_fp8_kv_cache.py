"""fp8 KV cache: kernels (reference, Triton), per-tensor scales, the engine's capacity and accuracy.

Tiers: the torch reference against the float32 path and against its own
dequantized cache; `KvCache` calibration; the Triton kernels against the
reference under TRITON_INTERPRET=1 and compiled for sm_90 (each in a
subprocess: this file run as a script, `_interpret_cases` / `_compile_cases`);
the engine (twice the tokens of bf16 in the same --kv-cache-memory,
teacher-forced greedy top-1 agreement with the float32 KV run).

NOTE: Triton's interpreter runs fp8 loads, casts and stores (as uint8 bit
patterns), but its float32 -> fp8 rounding drops the carry into the
exponent (127.9 -> 64 for e4m3, not 128). The interpreter write case
therefore uses inputs that need no rounding; the sm_90 compile case checks
that the GPU cast rounds to nearest even and saturates (cvt.rn.satfinite),
as torch's cast after the clamp does.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.paged_batches import make_paged_batch
from support.triton_backend import compile_env, requires_nvidia_backend, script_env
from trillium.kernels import reference
from trillium.kernels.fp8 import fp8_max, widen_fp8

REPO_ROOT = Path(__file__).resolve().parents[2]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Relative error (Frobenius) of attention over an fp8 cache vs float32: ~3% (e4m3), ~6% (e5m2).
MAX_REL_ERR = {torch.float8_e4m3fn: 0.06, torch.float8_e5m2: 0.12}
# Decode over several blocks, prefill, prefill over a prefix, a one-token prompt.
MIXED = ([1, 9, 1, 40, 1], [150, 9, 18, 70, 1])


def quantized(batch, dtype: torch.dtype, write=reference.write_kv_cache):
    """The batch's float caches written (every slot) into fp8 caches -> (k_cache, v_cache, k_scale, v_scale)."""
    num_blocks, block_size, kh, d = batch.k_cache.shape
    scales = [(c.abs().amax() * 2 / fp8_max(dtype)).reshape(()) for c in (batch.k_cache, batch.v_cache)]
    caches = [torch.zeros(batch.k_cache.shape, dtype=dtype) for _ in range(2)]
    rows = [c.reshape(num_blocks * block_size, kh, d) for c in (batch.k_cache, batch.v_cache)]
    write(*rows, *caches, torch.arange(num_blocks * block_size), *scales)
    return (*caches, *scales)


# ----------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2)])
def test_reference_fp8_attention_is_close_to_float32(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    batch = make_paged_batch(*MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32, block_size=16)
    k_cache, v_cache, k_scale, v_scale = quantized(batch, dtype)
    out = reference.paged_attention(batch.q, k_cache, v_cache, batch.meta, batch.scale, k_scale, v_scale)
    expected = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert ((out - expected).norm() / expected.norm()).item() < MAX_REL_ERR[dtype]
    # The scale folding (q * k_scale, out * v_scale) is exactly attention over the dequantized cache.
    dequantized = [c.float() * s for c, s in ((k_cache, k_scale), (v_cache, v_scale))]
    torch.testing.assert_close(out, reference.paged_attention(batch.q, *dequantized, batch.meta, batch.scale))


def test_reference_fp8_attention_with_bf16_queries() -> None:
    batch = make_paged_batch(*MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    k_cache, v_cache, k_scale, v_scale = quantized(batch, torch.float8_e4m3fn)
    q = batch.q.bfloat16()
    out = reference.paged_attention(q, k_cache, v_cache, batch.meta, batch.scale, k_scale, v_scale)
    expected = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - expected).norm() / expected.norm()).item() < 0.06


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_reference_reads_every_finite_fp8_code_exactly(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(16, 16)
    finite = codes.float().isfinite()
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = widen_fp8(codes, torch.empty(16, 16, dtype=out_dtype))
        assert torch.equal(got[finite], codes.float()[finite].to(out_dtype)), out_dtype


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_reference_write_divides_by_the_scale_and_saturates(dtype: torch.dtype) -> None:
    limit = fp8_max(dtype)
    k = torch.tensor([0.5, -3.0, 4 * limit, -4 * limit]).reshape(4, 1, 1).expand(4, 1, 2).contiguous()
    k_cache, v_cache = torch.zeros(1, 4, 1, 2, dtype=dtype), torch.zeros(1, 4, 1, 2, dtype=dtype)
    reference.write_kv_cache(k, k, k_cache, v_cache, torch.tensor([3, 2, 1, 0]), torch.tensor(0.5), None)
    assert k_cache[0, :, 0, 0].float().tolist() == [-limit, limit, -6.0, 1.0]  # saturated, never inf
    assert v_cache[0, :, 0, 0].float().tolist() == [-limit, limit, -3.0, 0.5]  # no scale: 1.0


def test_kv_cache_objects_calibrate_once_and_unpack() -> None:
    from trillium.models.config import ModelConfig
    from trillium.models.kv_cache import allocate_kv_caches, kv_cache_block_bytes
    from trillium.models.synthetic import hf_config_dict

    config = ModelConfig.from_hf_config(hf_config_dict("llama"))
    floats = allocate_kv_caches(config, 3, 16, "bfloat16", "cpu")
    fp8 = allocate_kv_caches(config, 3, 16, "fp8_e4m3", "cpu")
    assert floats[0].k_scale is None and floats[0].calibrated  # float caches do no scale work
    k_cache, v_cache = fp8[0]
    assert k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
    assert fp8[0].nbytes * 2 == floats[0].nbytes
    assert kv_cache_block_bytes(config, 16, "fp8_e5m2") * 4 == kv_cache_block_bytes(config, 16, "float32")
    cache = fp8[0]
    assert not cache.calibrated and cache.k_scale.item() == 1.0
    cache.calibrate(torch.zeros(0, 2, 16), torch.zeros(0, 2, 16))  # an empty write decides nothing
    assert not cache.calibrated
    cache.calibrate(torch.full((3, 2, 16), 9.0), torch.full((3, 2, 16), 0.25))
    assert cache.calibrated
    # amax x 2 / 448 rounded up to a power of two: 9 -> 0.0402 -> 2^-4; amax floor 1.0 -> 2^-7.
    assert (cache.k_scale.item(), cache.v_scale.item()) == (2.0**-4, 2.0**-7)
    cache.calibrate(torch.full((3, 2, 16), 100.0), torch.full((3, 2, 16), 100.0))
    assert cache.k_scale.item() == 2.0**-4  # fixed for the life of the cache


# ----------------------------------------------------------------- Triton (subprocesses)


def _run_self(mode: str, env: dict) -> None:
    proc = subprocess.run(
        [sys.executable, __file__, mode], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and f"{mode} ok" in proc.stdout, (proc.stdout + proc.stderr)[-6000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_fp8_kernels_match_reference_in_interpreter() -> None:
    _run_self("interpret", script_env(TRITON_INTERPRET="1", TRILLIUM_KERNELS=""))


@requires_nvidia_backend
def test_triton_fp8_kernels_compile_for_sm90(tmp_path: Path) -> None:
    env = compile_env(tmp_path, TRITON_DEFAULT_FP_FUSION="1")
    _run_self("compile", env)


def _interpret_cases() -> None:
    from trillium.kernels import triton_attention, triton_kv_cache

    assert triton_attention._interpreting()
    gen = torch.Generator().manual_seed(0)
    for dtype in FP8:
        # Writes: every finite code (times a power-of-two scale, so x / scale is exact) and
        # out-of-range values, which must saturate. Exact inputs, because the interpreter's
        # float32 -> fp8 rounding is wrong when it carries into the exponent (127.9 -> 64,
        # not 128); the GPU cast (cvt.rn.satfinite, checked in _compile_cases) rounds as torch.
        values = torch.randint(0, 256, (9, 2, 32), dtype=torch.uint8, generator=gen).view(dtype).float()
        values = torch.where(values.isfinite(), values, 0.0)
        values[0, 0, :4] = torch.tensor([10.0, -10.0, 1.001, -1.5]) * fp8_max(dtype)
        slots = torch.randperm(4 * 16, generator=gen)[:9]
        for src in (torch.float32, torch.bfloat16):
            k, v = (values * 0.25).to(src), (values * 4).to(src)
            got = [torch.zeros(4, 16, 2, 32, dtype=dtype) for _ in range(4)]
            triton_kv_cache.write_kv_cache(k, v, got[0], got[1], slots, torch.tensor(0.25), torch.tensor(4.0))
            reference.write_kv_cache(k, v, got[2], got[3], slots, torch.tensor(0.25), torch.tensor(4.0))
            assert torch.equal(got[0].view(torch.uint8), got[2].view(torch.uint8)), (dtype, src)
            assert torch.equal(got[1].view(torch.uint8), got[3].view(torch.uint8)), (dtype, src)
        # Attention over the same fp8 caches as the reference (loads and widening are exact).
        batch = make_paged_batch(*MIXED, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
        expected = quantized(batch, dtype)
        for q_dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
            q = batch.q.to(q_dtype)
            out = triton_attention.paged_attention(q, *expected[:2], batch.meta, batch.scale, *expected[2:])
            ref = reference.paged_attention(q, *expected[:2], batch.meta, batch.scale, *expected[2:])
            assert out.dtype == q_dtype
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    print("interpret ok")


def _compile_cases() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trillium.kernels import triton_attention, triton_kv_cache

    def compile_(fn, types: dict, constexprs: dict, arch: int = 90) -> str:
        signature = {}
        for name in fn.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in types:
                signature[name] = types[name]
            else:
                signature[name] = "fp32" if name == "scale_log2" else "i32"
        options = {"num_warps": 4, "num_stages": 2}
        kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=options)
        assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
        return kernel.asm["ptx"]

    for cache in ("fp8e4nv", "fp8e5"):
        for src in ("fp32", "bf16"):
            types = dict(k_ptr=f"*{src}", v_ptr=f"*{src}", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}",
                         k_scale_ptr="*fp32", v_scale_ptr="*fp32", slot_ptr="*i64")  # fmt: skip
            ptx = compile_(triton_kv_cache._write_kv_kernel, types, dict(BLOCK=512))
            # Round to nearest even and saturate, as torch's cast after the clamp does.
            assert f"cvt.rn.satfinite.{'e4m3' if cache == 'fp8e4nv' else 'e5m2'}x2.f32" in ptx
        for q, block_d, g_pad, block_m in (("bf16", 128, 1, 64), ("fp16", 64, 4, 16), ("fp32", 64, 4, 16)):
            types = dict(q_ptr=f"*{q}", out_ptr=f"*{q}", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}",
                         k_scale_ptr="*fp32", v_scale_ptr="*fp32", query_start_ptr="*i32", seq_lens_ptr="*i32",
                         block_tables_ptr="*i32")  # fmt: skip
            consts = dict(BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // g_pad, G_PAD=g_pad, BLOCK_N=64,
                          BLOCK_D=block_d, DOT_FP32=False, INPUT_PRECISION="ieee" if q == "fp32" else "tf32")  # fmt: skip
            compile_(triton_attention._paged_attention_kernel, types, consts)
    print("compile ok")


# ----------------------------------------------------------------- engine

KV_MEMORY = "4MiB"
PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(40 + 9 * i)] for i in range(4)]
NUM_NEW_TOKENS = 16


def _teacher_forced(llm, sequences: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Per sequence, over its last NUM_NEW_TOKENS positions: (argmax token, logprob of the sequence's token)."""
    from trillium import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    scored = []
    for seq, out in zip(sequences, llm.generate([{"prompt_token_ids": s} for s in sequences], params)):
        entries = out.prompt_logprobs[-NUM_NEW_TOKENS:]
        top1 = [next(t for t, lp in e.items() if lp.rank == 1) for e in entries]
        scored.append((top1, [e[t].logprob for e, t in zip(entries, seq[-NUM_NEW_TOKENS:])]))
    return scored


def test_fp8_kv_holds_twice_the_tokens_of_bf16_and_agrees_with_float32(checkpoint) -> None:
    from trillium import LLM, SamplingParams
    from trillium.config import EngineConfig

    path = str(checkpoint("llama"))
    bf16 = EngineConfig.build(model=path, dtype="bfloat16", kv_cache_memory=KV_MEMORY).resolve()
    fp32 = EngineConfig.build(model=path, kv_cache_memory=KV_MEMORY).resolve()
    assert (bf16.kv_cache_dtype, fp32.kv_cache_dtype) == ("bfloat16", "float32")  # auto: the model dtype
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with LLM(path, kv_cache_memory=KV_MEMORY, num_threads=1) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
        sequences = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)]
        reference_scores = _teacher_forced(llm, sequences)
    with LLM(path, kv_cache_dtype="fp8_e4m3", kv_cache_memory=KV_MEMORY, num_threads=1) as llm:
        assert llm.config.kv_cache_dtype == "fp8_e4m3"
        assert llm.config.num_kv_tokens == 2 * bf16.num_kv_tokens == 4 * fp32.num_kv_tokens
        fp8_scores = _teacher_forced(llm, sequences)
    agree = deltas = total = 0
    for (ref_top1, ref_lp), (top1, lp) in zip(reference_scores, fp8_scores):
        agree += sum(a == b for a, b in zip(ref_top1, top1))
        deltas += sum(abs(a - b) for a, b in zip(ref_lp, lp))
        total += len(top1)
    assert agree / total >= 0.9, f"top-1 agreement {agree}/{total}"
    assert deltas / total < 0.1, f"mean |delta logprob| {deltas / total}"


def test_kv_cache_dtype_flag_reaches_the_config(checkpoint) -> None:
    from trillium.cli import _engine_kwargs, build_parser
    from trillium.config import EngineConfig

    path = str(checkpoint("llama"))
    args = build_parser().parse_args(["generate", "--model", path, "--kv-cache-dtype", "fp8", "hi"])
    config = EngineConfig.build(model=path, **_engine_kwargs(args))
    assert config.kv_cache_dtype == "fp8" and config.resolve().kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig.from_bytes(config.to_bytes()) == config
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        EngineConfig.build(model=path, kv_cache_dtype="int8")


def test_wake_reallocates_fp8_caches_uncalibrated(checkpoint) -> None:
    from trillium.actors.executor.core import ExecutorCore
    from trillium.actors.executor.memory import DeviceMemory
    from trillium.config import EngineConfig

    config = EngineConfig.build(model=str(checkpoint("llama")), kv_cache_memory="1MiB", kv_cache_dtype="fp8_e5m2")
    core = ExecutorCore(config.resolve())
    core.kv_caches[0].calibrate(torch.ones(1, 2, 16), torch.ones(1, 2, 16))
    kv_bytes = sum(c.nbytes for c in core.kv_caches)
    memory = DeviceMemory(core)
    assert memory.sleep(1)["freed_kv_cache_bytes"] == kv_bytes
    memory.wake_up(("kv_cache",))
    assert all(not c.calibrated and c.k_cache.dtype == torch.float8_e5m2 for c in core.kv_caches)


if __name__ == "__main__":
    {"interpret": _interpret_cases, "compile": _compile_cases}[sys.argv[1]]()
