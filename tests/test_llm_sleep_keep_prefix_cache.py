"""--sleep-keep-prefix-cache end to end: the offline API over the real actors.

A prompt runs, the engine sleeps at level 1 and wakes, the same prompt runs
again. With the flag the device's cached blocks were saved to the host KV
tier at the sleep, so the second run loads them back (host hits, prefix
cache hit tokens) and its greedy output is identical to the first run's,
fp8 KV cache included (the wake keeps the scales the host blocks were
written with). Without the flag, or at level 2, nothing is left to hit.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from trillium import LLM, SamplingParams
from trillium.actors.executor.memory import DeviceMemory
from trillium.actors.protocol import admin as lc
from trillium.config import EngineConfig
from trillium.models.kv_cache import allocate_kv_caches

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
PROMPT_TOKENS = 50  # 3 full 16-token blocks and a partial one
ENGINE = {"num_blocks": 32, "max_num_seqs": 4, "max_num_batched_tokens": 64, "kv_host_bytes": "1MiB", "num_threads": 1}
_ids = itertools.count()


def control(llm: LLM, command_type, **fields) -> lc.ControlReply:
    reply = llm._call(llm._client.control, command_type(f"c{next(_ids)}", **fields))
    assert reply.ok, reply.message
    return reply


def run(llm: LLM, prompt: list[int]):
    output = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    return output.outputs[0].token_ids, output.num_cached_tokens


def host_hits(llm: LLM) -> int:
    host = llm.get_stats().kv_tiers[1]
    assert host.tier == "host"
    return host.hit_blocks_total


def sleep_and_wake(llm: LLM, level: int) -> lc.ControlReply:
    slept = control(llm, lc.Sleep, level=level)
    if level == 2:  # the weights were discarded: reload them (without flushing) before the wake
        control(llm, lc.UpdateWeightsFromDisk, model_path=llm.config.model, flush_cache=False)
    control(llm, lc.WakeUp)
    return slept


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(0)
    return [rng.randrange(7, 200) for _ in range(PROMPT_TOKENS)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_level_1_sleep_keeps_the_prefix_cache_in_the_host_tier(checkpoint, prompt, kv_cache_dtype):
    with LLM(str(checkpoint("llama")), sleep_keep_prefix_cache=True, kv_cache_dtype=kv_cache_dtype,
             **ENGINE) as llm:
        before, cached = run(llm, prompt)
        assert cached == 0 and host_hits(llm) == 0
        slept = sleep_and_wake(llm, level=1)
        assert slept.data["kept_prefix_cache"] and slept.data["num_saved_kv_blocks"] == 3
        after, cached = run(llm, prompt)
        assert host_hits(llm) == 3 and cached == 3 * 16
        assert llm.get_stats().kv_bytes_to_device_total == 3 * llm.config.kv_block_bytes
    assert after == before


@pytest.mark.parametrize("keep, level", [(False, 1), (True, 2)])
def test_without_the_flag_or_at_level_2_the_wake_starts_cold(checkpoint, prompt, keep, level):
    with LLM(str(checkpoint("llama")), sleep_keep_prefix_cache=keep, **ENGINE) as llm:
        before, _ = run(llm, prompt)
        slept = sleep_and_wake(llm, level=level)
        assert not slept.data["kept_prefix_cache"] and slept.data["num_saved_kv_blocks"] == 0
        after, cached = run(llm, prompt)
        assert host_hits(llm) == 0 and cached == 0
    assert after == before


def test_the_flag_needs_a_host_tier(checkpoint):
    path = str(checkpoint("llama"))
    with pytest.raises(ValueError, match="sleep-keep-prefix-cache.*kv-host-bytes"):
        EngineConfig.build(model=path, sleep_keep_prefix_cache=True)
    assert EngineConfig.build(model=path, kv_host_bytes="1MiB", sleep_keep_prefix_cache=True).sleep_keep_prefix_cache


def test_a_kept_prefix_cache_spills_past_a_small_host_tier_to_disk(checkpoint, prompt, tmp_path):
    # Four host slots for two prompts' six cached blocks: the spill at the sleep
    # pushes two on to the disk tier (written before the saves reuse their slots).
    path = str(checkpoint("llama"))
    block_bytes = EngineConfig.build(model=path, num_blocks=32).resolve().kv_block_bytes
    engine = {**ENGINE, "kv_host_bytes": f"{4 * block_bytes}B"}
    prompts = [prompt, [t + 1 for t in prompt]]
    with LLM(path, sleep_keep_prefix_cache=True, kv_disk_path=str(tmp_path), kv_disk_bytes="1MiB", **engine) as llm:
        before = [run(llm, p)[0] for p in prompts]
        sleep_and_wake(llm, level=1)
        after = [run(llm, p) for p in prompts]
        stats = llm.get_stats()
    device, host, disk = stats.kv_tiers
    assert stats.kv_bytes_to_disk_total >= 2 * block_bytes and disk.hit_blocks_total >= 2
    assert after == [(tokens, 3 * 16) for tokens in before]


def test_cli_flag_reaches_the_engine_config():
    from trillium.cli import _engine_kwargs, build_parser

    args = build_parser().parse_args(["generate", "--model", "m", "--kv-host-bytes", "1MiB",
                                      "--sleep-keep-prefix-cache", "hi"])
    assert _engine_kwargs(args)["sleep_keep_prefix_cache"] is True
    args = build_parser().parse_args(["generate", "--model", "m", "hi"])
    assert _engine_kwargs(args)["sleep_keep_prefix_cache"] is False


# -- the executor's memory: fp8 scales across a sleep ----------------------------


def fake_core(kv_cache_dtype: str):
    model_config = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4)
    core = SimpleNamespace(
        model_config=model_config, config=SimpleNamespace(num_blocks=4, block_size=2),
        kv_cache_dtype=kv_cache_dtype, device=torch.device("cpu"), host_kv=None,
        model=SimpleNamespace(local_config=model_config),  # a rank's KV shape (one rank here)
    )
    core.kv_caches = allocate_kv_caches(model_config, 4, 2, kv_cache_dtype, "cpu")
    return core


@pytest.mark.parametrize("keep", [True, False])
def test_a_kept_prefix_cache_keeps_the_fp8_scales_through_the_wake(keep):
    core = fake_core("fp8_e4m3")
    first, second = core.kv_caches
    first.calibrate(torch.full((2,), 100.0), torch.full((2,), 3.0))  # second: never written
    scales = (first.k_scale.item(), first.v_scale.item())
    assert scales != (1.0, 1.0)
    memory = DeviceMemory(core)
    memory.sleep(1, keep_prefix_cache=keep)
    memory.wake_up(("weights", "kv_cache"))
    first, second = core.kv_caches
    if keep:
        assert (first.k_scale.item(), first.v_scale.item()) == scales and first.calibrated
    else:
        assert (first.k_scale.item(), first.v_scale.item()) == (1.0, 1.0) and not first.calibrated
    assert not second.calibrated, "a layer never written stays uncalibrated"
    memory.sleep(1, keep_prefix_cache=keep)
    memory.forget_kv_scales()  # a weight update flushed the cache while asleep
    memory.wake_up(("kv_cache", "weights"))
    assert not core.kv_caches[0].calibrated
