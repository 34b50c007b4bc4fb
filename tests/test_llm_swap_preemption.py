"""Swap preemption end to end: the offline API over the real actors.

Many concurrent long greedy requests on a device KV cache far too small for
them all, so the scheduler keeps preempting. With `preemption_mode="swap"`
the preempted requests' KV goes to the host tier and comes back (swaps > 0);
the outputs are identical to a run that never preempts (a large cache) and
to preemption by recompute.
"""

from __future__ import annotations

import random

import pytest

from trillium import LLM, SamplingParams
from trillium.config import EngineConfig

BLOCK_SIZE = 8
NUM_DEVICE_BLOCKS = 12  # 96 tokens; the 8 requests need up to 8 x 56
NUM_HOST_BLOCKS = 64
MAX_NEW = 16
ENGINE = dict(block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=64)


def prompts(vocab: int) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(7, vocab) for _ in range(rng.randint(20, 40))]} for _ in range(8)]


def run(path, **engine) -> tuple[list[list[int]], object]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    with LLM(str(path), **ENGINE, **engine) as llm:
        outputs = llm.generate(prompts(llm.model_vocab_size), params)
        return [o.outputs[0].token_ids for o in outputs], llm.get_stats()


@pytest.fixture(scope="module")
def setup(checkpoint):
    path = checkpoint("llama")
    expected, stats = run(path, num_blocks=256)
    assert stats.num_preempted_total == 0
    block_bytes = EngineConfig.build(model=str(path), block_size=BLOCK_SIZE, num_blocks=2).resolve().kv_block_bytes
    return path, expected, block_bytes


def test_swap_preemption_matches_the_unpreempted_and_the_recompute_runs(setup):
    path, expected, block_bytes = setup
    host_bytes = f"{NUM_HOST_BLOCKS * block_bytes}B"
    swapped, stats = run(path, num_blocks=NUM_DEVICE_BLOCKS, kv_host_bytes=host_bytes, preemption_mode="swap")
    assert swapped == expected
    assert stats.num_preempted_total > 0
    assert stats.num_swapped_out_total > 0 and stats.num_swapped_in_total == stats.num_swapped_out_total
    assert stats.kv_bytes_to_device_total > 0
    recomputed, stats = run(path, num_blocks=NUM_DEVICE_BLOCKS, kv_host_bytes=host_bytes)
    assert recomputed == expected
    assert stats.num_preempted_total > 0 and stats.num_swapped_out_total == 0


def test_a_host_tier_too_small_to_swap_falls_back_to_recompute(setup):
    path, expected, block_bytes = setup
    tiny = f"{2 * block_bytes}B"  # 2 slots: no preempted request fits
    outputs, stats = run(path, num_blocks=NUM_DEVICE_BLOCKS, kv_host_bytes=tiny, preemption_mode="swap")
    assert outputs == expected
    assert stats.num_preempted_total > 0 and stats.num_swapped_out_total == 0


def test_config_and_cli_check_the_preemption_mode():
    assert EngineConfig.build(model="m").preemption_mode == "recompute"
    with pytest.raises(ValueError, match="needs --kv-host-bytes"):
        EngineConfig.build(model="m", preemption_mode="swap")
    with pytest.raises(ValueError, match="--preemption-mode must be one of"):
        EngineConfig.build(model="m", preemption_mode="migrate", kv_host_bytes="1MiB")
    config = EngineConfig.build(model="m", preemption_mode="swap", kv_host_bytes="1MiB")
    assert EngineConfig.from_bytes(config.to_bytes()) == config

    from trillium.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", "m", "--kv-host-bytes", "1GiB",
                                      "--preemption-mode", "swap", "hi"])
    assert args.preemption_mode == "swap"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "--preemption-mode", "migrate", "hi"])
