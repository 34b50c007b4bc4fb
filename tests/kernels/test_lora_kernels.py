"""Batched LoRA ops: the torch reference vs a naive per-token loop, and the Triton kernels.

Three tiers, as for the other kernels:
- the reference (`lora_reference`) against a float64 per-token oracle here;
- the Triton kernels against the reference under TRITON_INTERPRET=1, in a
  child pytest over `lora_interpret_cases.py` (Triton reads the variable once,
  at import; see test_kernels_triton_interpret.py);
- the Triton kernels compiled for sm_90 without a GPU (this file run as a
  script), which catches what the interpreter does not check.

`make_case` and `SEGMENT_LAYOUTS` (support/lora_op_cases.py) are shared with `lora_interpret_cases.py`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.lora_op_cases import SEGMENT_LAYOUTS, LoraCase, make_case
from support.triton_backend import compile_env, requires_nvidia_backend
from trillium.kernels import lora as lora_dispatch
from trillium.kernels import lora_reference

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("lora_interpret_cases.py")


def naive_lora(case: LoraCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, out after expand) token by token in float64: the definition, without segments."""
    num_tokens = case.x.shape[0]
    rank = case.a_stack.shape[1]
    out_features = case.b_stack.shape[1]
    slot_of_token = [-1] * num_tokens
    for start, length, slot in zip(*(t.tolist() for t in case.segments)):
        for t in range(start, start + length):
            slot_of_token[t] = slot
    y = torch.zeros(num_tokens, rank, dtype=torch.float64)
    out = case.out.double().clone()
    for t, slot in enumerate(slot_of_token):
        if slot < 0:
            continue
        y[t] = case.a_stack[slot].double() @ case.x[t].double()
        cols = slice(case.out_offset, case.out_offset + out_features)
        out[t, cols] += case.b_stack[slot].double() @ y[t]
    return y, out


@pytest.mark.parametrize("layout", list(SEGMENT_LAYOUTS))
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_reference_matches_naive_loop(layout: str, rank: int) -> None:
    lens, slots = SEGMENT_LAYOUTS[layout]
    case = make_case(lens, slots, rank=rank, in_features=40, out_features=24, strided_x=True, seed=rank)
    y = lora_reference.lora_shrink(case.x, case.a_stack, *case.segments)
    out = case.out.clone()
    lora_reference.lora_expand(y, case.b_stack, *case.segments, out, case.out_offset)
    y_naive, out_naive = naive_lora(case)
    assert y.dtype == torch.float32 and y.shape == (case.x.shape[0], rank)
    torch.testing.assert_close(y.double(), y_naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), out_naive, atol=1e-5, rtol=1e-5)


def test_reference_leaves_uncovered_rows_and_other_columns_alone() -> None:
    case = make_case([3, 4], [1, 0], rank=8, in_features=16, out_features=10, first_row=5)
    y = lora_reference.lora_shrink(case.x, case.a_stack, *case.segments)
    out = case.out.clone()
    lora_reference.lora_expand(y, case.b_stack, *case.segments, out, case.out_offset)
    assert torch.equal(y[:5], torch.zeros(5, 8))
    assert torch.equal(out[:5], case.out[:5])
    outside = torch.ones(out.shape[1], dtype=torch.bool)
    outside[case.out_offset : case.out_offset + 10] = False
    assert torch.equal(out[:, outside], case.out[:, outside])
    torch.testing.assert_close(out.double(), naive_lora(case)[1], atol=1e-5, rtol=1e-5)


def test_reference_bfloat16_rounds_once() -> None:
    # Slot 0's two short segments take the gathered path, slot 2's the sliced one.
    case = make_case([6, 5, 3], [0, 2, 0], rank=16, in_features=32, out_features=20, dtype=torch.bfloat16)
    y = lora_reference.lora_shrink(case.x, case.a_stack, *case.segments)
    out = case.out.clone()
    lora_reference.lora_expand(y, case.b_stack, *case.segments, out, case.out_offset)
    assert y.dtype == torch.float32 and out.dtype == torch.bfloat16
    y_naive, out_naive = naive_lora(case)
    torch.testing.assert_close(y.double(), y_naive, atol=1e-5, rtol=1e-5)
    # One bf16 rounding of the (float32) sum: at most one bf16 ulp from the exact one.
    torch.testing.assert_close(out.double(), out_naive, atol=1e-6, rtol=2**-8)


def test_reference_rejects_overlapping_or_unordered_segments() -> None:
    case = make_case([4, 4], [0, 1], rank=8, in_features=16, out_features=8)
    with pytest.raises(AssertionError, match="overlaps"):
        lora_reference.lora_shrink(case.x, case.a_stack, torch.tensor([2, 0]), case.seg_lens, case.seg_slots)


def test_dispatch_uses_reference_on_cpu() -> None:
    case = make_case([3, 2], [1, -1], rank=8, in_features=16, out_features=8)
    y = lora_dispatch.lora_shrink(case.x, case.a_stack, *case.segments)
    torch.testing.assert_close(y, lora_reference.lora_shrink(case.x, case.a_stack, *case.segments))
    out = case.out.clone()
    lora_dispatch.lora_expand(y, case.b_stack, *case.segments, out, case.out_offset)
    torch.testing.assert_close(out.double(), naive_lora(case)[1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_lora_kernels_match_reference_in_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", TRILLIUM_KERNELS="")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", str(CASES)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = (proc.stdout + proc.stderr)[-6000:]
    if proc.returncode == 0 and " passed" not in proc.stdout:
        pytest.skip(f"interpreter cases skipped:\n{report}")
    assert proc.returncode == 0, f"interpreter cases failed (rc={proc.returncode}):\n{report}"


# ---- sm_90 compile check (this file run as a script) ---------------------------


def _compile_for_sm90(fn, pointer_types: dict[str, str], constexprs: dict) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types[name]
        else:
            signature[name] = "i32"
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, "num_stages": 2},
    )
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"


def main() -> None:
    from trillium.kernels import triton_lora

    segs = {"seg_start_ptr": "*i32", "seg_len_ptr": "*i32", "seg_slot_ptr": "*i32"}
    # WHY not every (dtype, BLOCK_M) pair: each compile costs ~2 s of CI; every dtype and every
    # block size the wrapper picks (triton_lora.py) compiles at least once.
    for dtype, block_m in (("fp32", 16), ("bf16", 64), ("fp16", 16), ("fp16", 64)):
        precision = "ieee" if dtype == "fp32" else "tf32"
        _compile_for_sm90(
            triton_lora._lora_shrink_kernel,
            {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "y_ptr": "*fp32", **segs},
            dict(BLOCK_M=block_m, BLOCK_R=64, BLOCK_K=128, INPUT_PRECISION=precision),
        )
        _compile_for_sm90(
            triton_lora._lora_expand_kernel,
            {"y_ptr": "*fp32", "b_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", **segs},
            dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, INPUT_PRECISION=precision),
        )
    print("compiled")


@requires_nvidia_backend
def test_triton_lora_kernels_compile_for_sm90(tmp_path: Path) -> None:
    env = compile_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, __file__], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, (proc.stdout + proc.stderr)[-6000:]


if __name__ == "__main__":
    main()
