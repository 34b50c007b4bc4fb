"""Triton LoRA kernels vs the torch reference, run by Triton's CPU interpreter.

NOTE: not collected by the main pytest run (the name does not match
test_*.py): `test_lora_kernels.py` runs this file in a subprocess with
TRITON_INTERPRET=1, which Triton reads once at import.
Running it by hand: TRITON_INTERPRET=1 pytest tests/kernels/lora_interpret_cases.py
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from support.lora_op_cases import SEGMENT_LAYOUTS, make_case  # noqa: E402

from trillium.kernels import lora_reference, triton_lora  # noqa: E402

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def _run_both(case):
    y_ref = lora_reference.lora_shrink(case.x, case.a_stack, *case.segments)
    y = triton_lora.lora_shrink(case.x, case.a_stack, *case.segments)
    out_ref = case.out.clone()
    lora_reference.lora_expand(y_ref, case.b_stack, *case.segments, out_ref, case.out_offset)
    out = case.out.clone()
    triton_lora.lora_expand(y_ref, case.b_stack, *case.segments, out, case.out_offset)
    return y, y_ref, out, out_ref


# in/out features not multiples of the 16..128 blocks; rank 64 with a 200-wide
# input loops over two K blocks in the shrink.
@pytest.mark.parametrize("layout", list(SEGMENT_LAYOUTS))
@pytest.mark.parametrize(("rank", "in_features", "out_features"), [(8, 40, 24), (16, 72, 100), (64, 200, 40)])
def test_lora_kernels_match_reference(layout: str, rank: int, in_features: int, out_features: int) -> None:
    lens, slots = SEGMENT_LAYOUTS[layout]
    case = make_case(lens, slots, rank=rank, in_features=in_features, out_features=out_features, seed=rank)
    y, y_ref, out, out_ref = _run_both(case)
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, **TOLERANCE[torch.float32])
    torch.testing.assert_close(out, out_ref, **TOLERANCE[torch.float32])


def test_uncovered_rows_strided_views_and_fp16() -> None:
    """Leading rows outside every segment, a row-strided x, and half precision."""
    for dtype in (torch.float32, torch.float16):
        case = make_case([6, 1, 20], [2, -1, 0], rank=16, in_features=48, out_features=33,
                         first_row=5, strided_x=True, dtype=dtype)  # fmt: skip
        y, y_ref, out, out_ref = _run_both(case)
        torch.testing.assert_close(y, y_ref, **TOLERANCE[dtype])
        torch.testing.assert_close(out, out_ref, **TOLERANCE[dtype])
        assert torch.equal(out[:5], case.out[:5]) and not y[:5].any()


def test_expand_reads_a_column_slice_of_a_fused_shrink() -> None:
    """As the model does for q/k/v: y of 3R columns, each slice's R columns into its output columns."""
    rank, in_features = 8, 24
    case = make_case([3, 9, 1], [1, 0, 2], rank=3 * rank, in_features=in_features, out_features=8)
    y = triton_lora.lora_shrink(case.x, case.a_stack, *case.segments)
    widths = (16, 8, 8)
    gen = torch.Generator().manual_seed(5)
    b_stacks = [torch.randn(3, w, rank, generator=gen) for w in widths]
    out = torch.zeros(case.x.shape[0], sum(widths))
    out_ref = out.clone()
    offset = 0
    for i, (b, width) in enumerate(zip(b_stacks, widths)):
        y_slice = y[:, i * rank : (i + 1) * rank]
        assert not y_slice.is_contiguous()
        triton_lora.lora_expand(y_slice, b, *case.segments, out, offset)
        lora_reference.lora_expand(y_slice, b, *case.segments, out_ref, offset)
        offset += width
    torch.testing.assert_close(out, out_ref, **TOLERANCE[torch.float32])


def test_model_forward_with_triton_lora_matches_reference_path(checkpoint, monkeypatch) -> None:
    """The whole multi-LoRA model path (slots layout, fused slices) with the ops routed to Triton."""
    from support.lora_adapters import ADAPTERS, random_adapter
    from support.lora_batches import LENGTHS, run_phase
    from support.paged_runner import random_sequences
    from trillium.kernels import lora as lora_dispatch
    from trillium.lora import LoRASlots
    from trillium.models import load_model

    model, config = load_model(checkpoint("llama"), progress=False)
    slots = LoRASlots(config, max_loras=2, max_rank=16, dtype=torch.float32)
    slots.load(0, random_adapter(config, ADAPTERS["all"]["target_modules"], rank=16, seed=1))
    slots.load(1, random_adapter(config, ["q_proj", "v_proj", "down_proj"], rank=8, seed=2))
    sequences = random_sequences(config.vocab_size, lengths=LENGTHS, seed=7)
    assignment = [1, 0, 0, -1]
    reference = run_phase(model, slots, assignment, sequences)
    monkeypatch.setattr(lora_dispatch, "wants_triton", lambda tensor: True)
    triton = run_phase(model, slots, assignment, sequences)
    for a, b in zip(triton, reference):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
