"""The engine's actors as separate processes over ipc://, driven by an EngineClient.

The same actors `trillium.LLM` runs in-process; here each is a child
process, as `trillium serve` runs them. A killed actor process surfaces as
ActorFailed naming it, and no child is left behind.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio

from trillium import LLM, SamplingParams
from trillium.actors.client import EngineClient
from trillium.actors.assembly import ActorConfig, Addresses, engine_specs
from trillium.actors.supervisor import ActorFailed, run_in_subprocesses
from trillium.config import EngineConfig


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in _leaves(e)]
    return [group]


async def _collect(stream) -> list[int]:
    tokens: list[int] = []
    async for delta in stream:
        tokens.extend(delta.new_token_ids)
    return tokens


async def test_engine_in_subprocesses_matches_in_process(checkpoint, tmp_path):
    path = str(checkpoint("llama"))
    engine = EngineConfig(model=path, kv_cache_memory="8MiB").resolve()
    config = ActorConfig(engine, Addresses.ipc(str(tmp_path)))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(10, 60))]
    client = EngineClient(config)
    results: list[list[int]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        supervision = await nursery.start(run_in_subprocesses, engine_specs(config))
        pids = dict(supervision.pids)
        assert set(pids) == {"executor", "detokenizer", "scheduler"}
        for i, prompt in enumerate(prompts):
            stream = await client.submit(f"r{i}", prompt, params, (2,))
            results.append(await _collect(stream))
        nursery.cancel_scope.cancel()
    client.close()
    for pid in pids.values():
        assert not _alive(pid)

    def in_process() -> list[list[int]]:
        with LLM(path, kv_cache_memory="8MiB") as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outputs]

    # LLM runs its own trio loop in a thread; drive it from a worker thread.
    assert results == await trio.to_thread.run_sync(in_process)


async def test_killed_actor_process_fails_the_engine_cleanly(checkpoint, tmp_path):
    path = str(checkpoint("llama"))
    engine = EngineConfig(model=path, kv_cache_memory="8MiB").resolve()
    config = ActorConfig(engine, Addresses.ipc(str(tmp_path)))
    pids: dict[str, int] = {}
    with pytest.raises(BaseExceptionGroup) as info:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                supervision = await nursery.start(run_in_subprocesses, engine_specs(config))
                pids.update(supervision.pids)
                os.kill(pids["executor"], signal.SIGKILL)
                await trio.sleep_forever()
    failed = info.value.subgroup(lambda e: isinstance(e, ActorFailed))
    assert failed is not None
    assert [e.name for e in _leaves(failed)] == ["executor"]
    for pid in pids.values():
        assert not _alive(pid)
