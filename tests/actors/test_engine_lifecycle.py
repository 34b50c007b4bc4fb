"""The control plane's engine side, end to end over the real actors.

In-process engines (the actors `trillium.LLM` runs, driven by an
EngineClient in the test's trio loop) exercise pause / resume in its three
modes with requests in flight, sleep levels 1 and 2 and waking, weight
updates from disk, from safetensors bytes and over a gloo group with a
trainer in a subprocess, the 409 / 400 / 504 answers, and profiling. The
oracle for "same outputs" is an uninterrupted offline `LLM` on the same
checkpoint. One engine runs as child processes, to see the executor's
resident memory really drop on sleep.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import trio
from safetensors.torch import load_file, save

from trillium.models.gguf_writer import write_gguf
from trillium import LLM, SamplingParams
from trillium.actors.client import EngineClient
from trillium.actors.assembly import ActorConfig, Addresses, engine_specs
from trillium.actors.protocol import admin as lc
from trillium.actors.supervisor import run_in_process, run_in_subprocesses
from trillium.config import EngineConfig

PROMPTS = [[5, 6, 7, 8], list(range(20, 70)), [100, 3, 17, 250, 9, 9, 31]]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
EOS = (2,)
ENGINE_ARGS = {"kv_cache_memory": "8MiB", "num_threads": 1}
_ids = itertools.count()


def greedy_offline(path: Path, prompts=PROMPTS) -> list[list[int]]:
    with LLM(str(path), **ENGINE_ARGS) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from trillium.models.synthetic import build_checkpoint

    root = tmp_path_factory.mktemp("lifecycle")
    return [build_checkpoint(root / f"seed{seed}", "llama", seed=seed) for seed in (0, 1)]


@pytest.fixture(scope="module")
def expected(checkpoints):
    """Uninterrupted greedy outputs of each checkpoint (offline LLM)."""
    outputs = [greedy_offline(path) for path in checkpoints]
    assert outputs[0] != outputs[1], "the two checkpoints must generate differently"
    return outputs


class Engine:
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def control(self, command_type, **fields) -> lc.ControlReply:
        return await self.client.control(command_type(f"c{next(_ids)}", **fields), timeout_s=60)

    async def info(self) -> dict:
        return (await self.control(lc.GetEngineInfo)).data

    async def submit(self, prompt, params=GREEDY) -> "Run":
        run = Run()
        run.request_id = f"r{next(_ids)}"
        stream = await self.client.submit(run.request_id, prompt, params, EOS)
        self.nursery.start_soon(run.consume, stream)
        return run

    async def generate(self, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
        runs = [await self.submit(p, params) for p in prompts]
        for run in runs:
            await run.done.wait()
        return [run.tokens for run in runs]


class Run:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.started = trio.Event()
        self.done = trio.Event()

    async def consume(self, stream) -> None:
        async for delta in stream:
            self.tokens.extend(delta.new_token_ids)
            self.text += delta.text
            self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
            if self.tokens:
                self.started.set()
            if delta.finished:
                self.finish_reason = delta.finish_reason
        self.done.set()


@contextlib.asynccontextmanager
async def engine(path: Path, *, subprocesses: bool = False, directory: str | None = None, **engine_args):
    args = {**ENGINE_ARGS, **engine_args}
    addresses = Addresses.ipc(directory) if subprocesses else Addresses.inproc()
    config = ActorConfig(EngineConfig(model=str(path), **args).resolve(), addresses)
    client = EngineClient(config)
    runner = run_in_subprocesses if subprocesses else run_in_process
    try:
        with trio.fail_after(150):
            async with trio.open_nursery() as nursery:
                await nursery.start(client.run)
                handle = Engine(client)
                handle.supervision = await nursery.start(runner, engine_specs(config))
                handle.nursery = nursery
                yield handle
                nursery.cancel_scope.cancel()
    finally:
        client.close()


# -- pause / resume -----------------------------------------------------------


async def test_keep_mode_pause_and_sleep_continue_to_identical_outputs(checkpoints, expected):
    async with engine(checkpoints[0]) as e:
        runs = [await e.submit(p) for p in PROMPTS]
        await runs[0].started.wait()
        reply = await e.control(lc.Pause, mode="keep")
        assert reply.ok and reply.data["state"] == "paused"
        assert reply.data["num_running"] + reply.data["num_waiting"] == len(PROMPTS)
        # NOTE: the last step's tokens travel via the detokenizer, the reply
        # straight to the api: let them land before taking the snapshot.
        await trio.sleep(0.1)
        frozen = [len(r.tokens) for r in runs]
        await trio.sleep(0.3)
        assert [len(r.tokens) for r in runs] == frozen, "nothing steps while paused"
        assert e.client.last_stats.engine_state == "paused"
        assert (await e.control(lc.Resume)).ok
        for run in runs:
            await run.done.wait()
        assert [r.tokens for r in runs] == expected[0]

        # Sleep in keep mode: the KV goes, the requests stay and recompute after the wake.
        longer = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        uninterrupted = await e.generate(PROMPTS, longer)
        assert (await e.control(lc.ResetPrefixCache)).ok
        runs = [await e.submit(p, longer) for p in PROMPTS]
        await runs[0].started.wait()
        slept = await e.control(lc.Sleep, level=1, mode="keep")
        assert slept.ok and slept.data["num_running"] == 0 and slept.data["num_waiting"] == len(PROMPTS)
        assert (await e.control(lc.WakeUp)).ok
        for run in runs:
            await run.done.wait()
        assert [r.tokens for r in runs] == uninterrupted


async def test_pause_abort_ends_requests_with_partial_text_and_queues_new_ones(checkpoints, expected):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    async with engine(checkpoints[0]) as e:
        runs = [await e.submit(p, long) for p in PROMPTS[:2]]
        await runs[0].started.wait()
        reply = await e.control(lc.Pause, mode="abort")
        assert reply.ok and reply.data["num_aborted"] == 2
        for run in runs:
            await run.done.wait()
            assert run.finish_reason == "abort" and len(run.tokens) < 200
        assert runs[0].tokens and runs[0].text, "partial output is delivered"
        late = await e.submit(PROMPTS[0])
        await trio.sleep(0.3)
        assert late.tokens == [] and (await e.info())["num_waiting"] == 1
        await e.control(lc.Resume)
        await late.done.wait()
        assert late.tokens == expected[0][0] and late.finish_reason == "length"

        victim, bystander = await e.submit(PROMPTS[0], long), await e.submit(PROMPTS[1])
        await victim.started.wait()
        reply = await e.control(lc.AbortRequests, request_ids=(victim.request_id, "no-such-request"))
        assert reply.ok and reply.data["num_aborted"] == 1
        await victim.done.wait()
        await bystander.done.wait()
        assert victim.finish_reason == "abort" and bystander.tokens == expected[0][1]


async def test_pause_wait_drains_running_requests_then_holds_new_ones(checkpoints, expected):
    longer = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    async with engine(checkpoints[0]) as e:
        runs = [await e.submit(p, longer) for p in PROMPTS[:2]]
        await runs[0].started.wait()
        async with trio.open_nursery() as nursery:
            replies = []

            async def pause():
                replies.append(await e.control(lc.Pause, mode="wait"))

            nursery.start_soon(pause)
            await trio.sleep(0.01)
            assert (await e.info())["state"] == "draining"
            late = await e.submit(PROMPTS[2])
        assert replies[0].ok and replies[0].data["state"] == "paused"
        assert replies[0].data["num_running"] == 0
        for run, tokens in zip(runs, expected[0]):
            await run.done.wait()  # NOTE: outputs go via the detokenizer, the reply does not
            assert run.finish_reason == "length" and len(run.tokens) == 150, "started requests finish in full"
            assert run.tokens[:MAX_TOKENS] == tokens
        assert late.tokens == [] and replies[0].data["num_waiting"] == 1
        await e.control(lc.Resume)
        await late.done.wait()
        assert late.tokens == expected[0][2]


# -- sleep / wake ----------------------------------------------------------------


async def test_sleep_levels_and_wake_keep_greedy_outputs(checkpoints, expected):
    async with engine(checkpoints[0]) as e:
        assert await e.generate() == expected[0]
        again = await e.submit(PROMPTS[1])
        await again.done.wait()
        assert again.num_cached_tokens > 0, "the prefix cache serves a repeated prompt"
        slept = await e.control(lc.Sleep, level=1)
        assert slept.ok and slept.data["state"] == "sleeping" and slept.data["sleep_level"] == 1
        assert slept.data["freed_kv_cache_bytes"] > 0 and slept.data["num_blocks"] > 0
        assert (await e.control(lc.Resume)).status == 409
        assert (await e.control(lc.Sleep, level=2)).status == 409
        waiting = await e.submit(PROMPTS[1])
        await trio.sleep(0.2)
        assert waiting.tokens == [] and e.client.last_stats.engine_state == "sleeping"
        woke = await e.control(lc.WakeUp)
        assert woke.ok and woke.data["state"] == "serving" and woke.data["sleep_level"] == 0
        await waiting.done.wait()
        assert waiting.tokens == expected[0][1]
        assert waiting.num_cached_tokens == 0, "the KV content is gone: no prefix hit after a wake"
        assert (await e.info())["kv_usage"] == 0.0
        assert (await e.control(lc.WakeUp)).ok, "waking an awake engine is a no-op"
        assert await e.generate() == expected[0]

        assert (await e.control(lc.Sleep, level=1, mode="keep")).ok
        weights_first = await e.control(lc.WakeUp, tags=("weights",))
        assert weights_first.ok and weights_first.data["asleep"] == ["kv_cache"]
        assert weights_first.data["state"] == "sleeping"
        assert (await e.control(lc.WakeUp, tags=("kv_cache",))).data["state"] == "serving"
        assert await e.generate() == expected[0]

        slept = await e.control(lc.Sleep, level=2)
        assert slept.ok and slept.data["freed_weight_bytes"] > 0
        refused = await e.control(lc.WakeUp, tags=("weights",))
        assert refused.status == 409 and "update the weights" in refused.message
        kv = await e.control(lc.WakeUp, tags=("kv_cache",))
        assert kv.ok and kv.data["state"] == "sleeping" and kv.data["asleep"] == ["weights"]
        updated = await e.control(lc.UpdateWeightsFromDisk, model_path=str(checkpoints[0]))
        assert updated.ok and updated.data["state"] == "sleeping" and updated.data["weight_version"] == "1"
        woke = await e.control(lc.WakeUp, tags=("weights",))
        assert woke.ok and woke.data["state"] == "serving"
        assert await e.generate() == expected[0]


# -- weight updates ---------------------------------------------------------------


async def test_weight_updates_from_disk_gguf_and_tensors_switch_models(checkpoints, expected, tmp_path):
    seed0 = save(load_file(str(checkpoints[0] / "model.safetensors")))
    async with engine(checkpoints[0]) as e:
        assert await e.generate() == expected[0]
        # An update while serving lands between two steps; the running request goes on.
        running = await e.submit(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
        await running.started.wait()
        reply = await e.control(lc.UpdateWeightsFromDisk, model_path=str(checkpoints[1]))
        assert reply.ok and reply.data["weight_version"] == "1" and reply.data["state"] == "serving"
        assert reply.data["model_path"] == str(checkpoints[1])
        assert e.client.last_stats.weight_version == "1"
        await running.done.wait()
        assert running.finish_reason == "length" and len(running.tokens) == 120
        assert await e.generate() == expected[1]

        reply = await e.control(lc.UpdateWeightsFromTensors, safetensors=np.frombuffer(seed0, np.uint8),
                                weight_version="rl-step-7")
        assert reply.ok and reply.data["weight_version"] == "rl-step-7"
        assert await e.generate() == expected[0]

        gguf = write_gguf(checkpoints[1], tmp_path / "seed1.gguf")
        reply = await e.control(lc.UpdateWeightsFromDisk, model_path=str(gguf))
        assert reply.ok, reply.message
        assert reply.data["weight_version"] == "rl-step-8"
        assert await e.generate() == expected[1]

        bad = [
            {"model.layers.0.mlp.down_proj.weight": np.zeros((64, 128), np.float32),
             "model.layers.0.mlp.not_a_proj.weight": np.zeros((4, 4), np.float32)},
            {"model.layers.1.self_attn.q_proj.weight": np.zeros((64, 63), np.float32)},
            {"model.norm.weight": np.zeros(64, np.int32)},
        ]
        for tensors in bad:
            import torch

            blob = save({k: torch.from_numpy(v) for k, v in tensors.items()})
            reply = await e.control(lc.UpdateWeightsFromTensors, safetensors=np.frombuffer(blob, np.uint8))
            assert reply.status == 400, reply
        reply = await e.control(lc.UpdateWeightsFromTensors, safetensors=np.zeros(10, np.uint8))
        assert reply.status == 400
        reply = await e.control(lc.UpdateWeightsFromDisk, model_path=str(checkpoints[0] / "nope"))
        assert reply.status == 400
        info = await e.info()
        assert info["weight_version"] == "rl-step-8" and info["state"] == "serving"
        assert await e.generate() == expected[1], "failed updates left the weights alone"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TRAINER = textwrap.dedent(
    """
    import sys
    from safetensors.torch import load_file
    from trillium.distributed.update_group import broadcast, close_group, open_group
    port, path = int(sys.argv[1]), sys.argv[2]
    weights = load_file(path)
    group = open_group("127.0.0.1", port, rank=0, world_size=2, group_name="rl", timeout_s=60)
    for name in sorted(weights):
        broadcast(group, weights[name].contiguous())
    print("sent", len(weights), flush=True)
    # WHY wait: as a real trainer waits for the engine's reply to the update before it
    # moves on; rank 0 hosts the store, and tearing it down while the engine still
    # receives aborts this process under load ("terminate called without an active exception").
    sys.stdin.read()  # until the test has the engine's reply and closes our stdin
    close_group(group)  # NOTE: a gloo group still alive at interpreter exit aborts the process
    """
)


SILENT_TRAINER = textwrap.dedent(
    """
    import sys
    from trillium.distributed.update_group import close_group, open_group
    print("ready", flush=True)  # imports done: the store is up a moment later
    group = open_group("127.0.0.1", int(sys.argv[1]), rank=0, world_size=2, group_name="quiet", timeout_s=10)
    sys.stdin.read()  # until the test closes our stdin
    close_group(group)
    """
)


async def test_weight_update_over_a_gloo_group_from_a_trainer_process(checkpoints, expected, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    weights = load_file(str(checkpoints[1] / "model.safetensors"))
    names = sorted(weights)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    async with engine(checkpoints[0]) as e:
        assert (await e.control(lc.UpdateWeightsFromDistributed, names=("x",), dtypes=("float32",),
                                shapes=((1,),))).status == 409
        port = _free_port()
        async with trio.open_nursery() as nursery:
            trainer_process = await nursery.start(partial(
                trio.run_process, [sys.executable, str(script), str(port), str(checkpoints[1] / "model.safetensors")],
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, check=False,
            ))
            joined = await e.control(lc.InitWeightsUpdateGroup, master_address="127.0.0.1", master_port=port,
                                     rank_offset=1, world_size=2, group_name="rl", timeout_s=60)
            assert joined.ok, joined.message
            assert joined.data["weights_update_group"] == "rl"
            reply = await e.control(
                lc.UpdateWeightsFromDistributed, names=tuple(names), dtypes=("float32",) * len(names),
                shapes=tuple(tuple(weights[n].shape) for n in names), weight_version="dist-1",
            )
            sent = await trainer_process.stdout.receive_some()
            await trainer_process.stdin.aclose()  # the reply is in: the trainer may close its end
        assert trainer_process.returncode == 0 and b"sent" in sent, (trainer_process.returncode, sent)
        assert reply.ok, reply.message
        assert reply.data["weight_version"] == "dist-1"
        assert await e.generate() == expected[1]
        assert (await e.control(lc.DestroyWeightsUpdateGroup)).ok
        assert (await e.control(lc.DestroyWeightsUpdateGroup)).status == 409

        # A trainer that joins and then never sends: the receive times out,
        # the engine answers 504 and closes the (now misaligned) group.
        # NOTE: a process of its own: torch registers group names per process, and
        # this engine runs in the test's process.
        silent = tmp_path / "silent_trainer.py"
        silent.write_text(SILENT_TRAINER)
        port = _free_port()
        async with trio.open_nursery() as nursery:
            trainer_process = await nursery.start(partial(
                trio.run_process, [sys.executable, str(silent), str(port)], env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            ))
            # WHY wait for it: this join's 2 s timeout is shorter than a Python start with torch.
            assert b"ready" in await trainer_process.stdout.receive_some()
            joined = await e.control(lc.InitWeightsUpdateGroup, master_address="127.0.0.1", master_port=port,
                                     rank_offset=1, world_size=2, group_name="quiet", timeout_s=2)
            assert joined.ok, joined.message
            stuck = await e.control(lc.UpdateWeightsFromDistributed, names=(names[0],), dtypes=("float32",),
                                    shapes=(tuple(weights[names[0]].shape),))
            await trainer_process.stdin.aclose()  # release it
        assert stuck.status == 504 and stuck.data["weights_update_group"] is None, stuck
        assert stuck.data["weight_version"] == "dist-1" and stuck.data["state"] == "serving"

        lonely = await e.control(lc.InitWeightsUpdateGroup, master_address="127.0.0.1", master_port=_free_port(),
                                 rank_offset=1, world_size=2, timeout_s=1.0)
        assert lonely.status == 504 and "did not join" in lonely.message
        refused = await e.control(lc.InitWeightsUpdateGroup, master_address="127.0.0.1", master_port=1,
                                  rank_offset=1, world_size=2, backend="nccl")
        assert refused.status == 400
        assert (await e.info())["weights_update_group"] is None
        assert await e.generate() == expected[1], "still serving after the failed joins"


# -- profiling ------------------------------------------------------------------


async def test_profile_start_stop_writes_files(checkpoints, tmp_path):
    async with engine(checkpoints[0]) as e:
        assert (await e.control(lc.StopProfile)).status == 409
        started = await e.control(lc.StartProfile, profile_dir=str(tmp_path / "prof"))
        assert started.ok and started.data["profiling"]
        assert (await e.control(lc.StartProfile, profile_dir=str(tmp_path))).status == 409
        await e.generate(PROMPTS[:1])
        stopped = await e.control(lc.StopProfile)
        assert stopped.ok, stopped.message
        files = [Path(f) for f in stopped.data["files"]]
        assert all(f.exists() and f.stat().st_size > 0 for f in files)
        names = {f.name.split("-")[0] for f in files}
        assert names == {"executor", "scheduler", "detokenizer"}
        trace = json.loads(next(f for f in files if f.name.startswith("executor")).read_text())
        assert any(ev.get("name", "").startswith("aten::") for ev in trace["traceEvents"])
        assert (await e.control(lc.StopProfile)).status == 409

        # Bounded in time: every actor stops by itself; Stop hands the files out.
        started = await e.control(lc.StartProfile, profile_dir=str(tmp_path / "auto"), max_duration_s=0.2)
        assert started.ok
        await trio.sleep(0.5)
        await e.generate(PROMPTS[:1])  # nothing is recorded any more
        stopped = await e.control(lc.StopProfile)
        assert stopped.ok and len(stopped.data["files"]) == len(files)
        assert all(Path(f).exists() for f in stopped.data["files"])


async def test_timeline_profile_records_step_stages(checkpoints, tmp_path):
    """StartProfile(timeline=True): spans only (no cProfile, no torch.profiler), the
    executor's step stages among them, readable by bench/step_timeline.py's parser. Synchronous
    steps, as `trillium bench timeline` runs them: its report (and the nesting checked here) assumes
    one step out at a time, which an unset --async-scheduling does not keep at small batches."""
    from trillium.benchmarks.timeline_report import load_spans

    async with engine(checkpoints[0], async_scheduling=False) as e:
        started = await e.control(lc.StartProfile, profile_dir=str(tmp_path / "tl"), timeline=True)
        assert started.ok, started.message
        await e.generate(PROMPTS[:2])
        stopped = await e.control(lc.StopProfile)
        assert stopped.ok, stopped.message
        files = stopped.data["files"]
        assert not any(f.endswith(".prof") or f.endswith(".pt.trace.json") for f in files), files
        spans = load_spans(files)
        names = {actor: {s.name for s in actor_spans} for actor, actor_spans in spans.items()}
        assert {"ExecuteBatch", "inputs", "forward", "sample", "result", "send BatchResult"} <= names["executor"]
        assert {"schedule", "BatchResult", "send ExecuteBatch"} <= names["scheduler"]
        assert {"TokenDeltas", "send RequestOutputs"} <= names["detokenizer"]
        steps = [s for s in spans["executor"] if s.name == "ExecuteBatch"]
        forwards = [s for s in spans["executor"] if s.name == "forward"]
        assert len(forwards) == len(steps) >= 2
        assert all(st.start <= f.start and f.end <= st.end for st, f in zip(steps, forwards))
        # A timeline does not leave the torch profiler on: a normal profile still starts.
        assert (await e.control(lc.StartProfile, profile_dir=str(tmp_path / "p2"))).ok
        assert (await e.control(lc.StopProfile)).ok


# -- memory really goes back to the OS ----------------------------------------------


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_sleep_releases_executor_memory(checkpoints, expected, tmp_path):
    async with engine(checkpoints[0], subprocesses=True, directory=str(tmp_path),
                      kv_cache_memory="256MiB") as e:
        pid = e.supervision.pids["executor"]
        assert await e.generate(PROMPTS[:1]) == expected[0][:1]
        before = _rss_bytes(pid)
        slept = await e.control(lc.Sleep, level=1)
        kv_bytes = slept.data["freed_kv_cache_bytes"]
        assert kv_bytes >= 250 * 2**20
        assert before - _rss_bytes(pid) >= 0.8 * kv_bytes, (before, _rss_bytes(pid), kv_bytes)
        assert (await e.control(lc.WakeUp)).ok
        assert _rss_bytes(pid) - before > -0.2 * kv_bytes, "the KV cache is back"
        assert await e.generate(PROMPTS[:1]) == expected[0][:1]

        before = _rss_bytes(pid)
        slept = await e.control(lc.Sleep, level=2)
        freed = slept.data["freed_kv_cache_bytes"] + slept.data["freed_weight_bytes"]
        assert slept.data["freed_weight_bytes"] > 0
        assert before - _rss_bytes(pid) >= 0.8 * freed, (before, _rss_bytes(pid), freed)
        assert (await e.control(lc.UpdateWeightsFromDisk, model_path=str(checkpoints[0]))).ok
        assert (await e.control(lc.WakeUp)).ok
        assert await e.generate(PROMPTS[:1]) == expected[0][:1]
