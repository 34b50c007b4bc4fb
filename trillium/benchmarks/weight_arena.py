"""Weights in one huge-page arena vs one allocation each, side by side in one run (`bench/weight_arena.py`).

One in-process executor (compiled decode at batch 1, the `bench` model or
--model) whose weights the loader put in the arena (models/weight_arena.py).
A second copy of every weight, one plain allocation per tensor as a model
had them before the arena, is swapped in and out between rounds, so both
layouts run the same graph on the same machine moments apart:

  linears   the step's float32 linears alone (dense_cpu.c through the
            graph's op), every weight of the model once: ms, GB/s
  decode    one request, 128-token prompt, --tokens greedy tokens through
            the scheduler and executor cores (no IPC): median ms per
            decode step, tok/s

Prints medians over --rounds rounds per layout (alternating) and the greedy
tokens' agreement; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


class _Layouts:
    """The model's weights in two layouts, each swapped in whole: the arena's views and plain copies."""

    def __init__(self, model: torch.nn.Module) -> None:
        named = {id(t): t for _, t in [*model.named_parameters(), *model.named_buffers()]}
        self.tensors = [t for t in named.values() if t.device.type == "cpu" and t.numel() > 0]
        self.arena = [t.data for t in self.tensors]
        self.plain = [torch.empty_like(t).copy_(t) for t in self.tensors]  # one allocation each

    def use(self, layout: str) -> None:
        with torch.no_grad():
            for tensor, data in zip(self.tensors, getattr(self, layout)):
                if isinstance(tensor, torch.nn.Parameter):
                    tensor.data = data
                else:
                    tensor.set_(data)


def _linears_s(model: torch.nn.Module) -> tuple[float, int]:
    """One pass of the model's float32 2-D weights through the decode op at one row: (seconds, bytes)."""
    from trillium.kernels import native_ops

    op = torch.ops.trillium_native.cpu_linear if native_ops.load() else torch.ops.trillium.cpu_linear
    weights = list({id(m.weight): m.weight for m in model.modules()  # the LM head too (tied or not)
                    if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
                    and m.weight.dtype == torch.float32 and not isinstance(m, torch.nn.Embedding)}.values())
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    start = time.perf_counter()
    for w in weights:
        op(xs[w.shape[1]], w, None)
    return time.perf_counter() - start, sum(w.numel() * 4 for w in weights)


def rounds_arg(text: str) -> int:
    """argparse type of --rounds: an int in 1..1000."""
    value = int(text)
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be in 1..1000, got {value}")
    return value


def decode_steps(core, sched, request_id: str, tokens: int) -> tuple[list[float], list[int]]:
    """One greedy request (128-token prompt) through the scheduler and executor cores, in process:
    (seconds of each decode step, the sampled tokens). Also bench/graph_wrapper.py's."""
    from trillium.actors.protocol.requests import AddRequest
    from trillium.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = (np.arange(128, dtype=np.int32) * 37) % 8000 + 5
    sched.add_request(AddRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params,
                                 eos_token_ids=(2,), arrival_time=time.time()))  # fmt: skip
    step_s, out = [], []
    while sched.has_work():
        batch = sched.schedule()
        if batch is None:
            break
        start = time.perf_counter()
        result = core.execute(batch)
        step_s.append(time.perf_counter() - start)
        out.extend(int(t) for t in np.asarray(result.sampled_token_ids).ravel())
        sched.update_from_output(result)
    return step_s[1:], out  # decode steps (the first one is the prefill)


def in_process_parser(doc: str) -> argparse.ArgumentParser:
    """The options of an in-process decode bench (this one and bench/graph_wrapper.py)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint dir (default: build the bench model in a temp dir)")
    parser.add_argument("--rounds", type=rounds_arg, default=8, metavar="N", help="alternated rounds, 1-1000 (default 8)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    return parser


def in_process_engine(args: argparse.Namespace, **engine_args):
    """(executor core, scheduler core) on --model (or the bench model, built in a temp dir), --threads."""
    from trillium.actors.executor.core import ExecutorCore
    from trillium.actors.scheduler.core import build_scheduler
    from trillium.config import EngineConfig
    from trillium.models.synthetic import build_checkpoint

    torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        model_dir = str(Path(tempfile.mkdtemp(prefix="trillium-bench-")) / "bench")
        build_checkpoint(model_dir, "bench", seed=0)
    config = EngineConfig.build(model=model_dir, kv_cache_memory="64MiB", **engine_args).resolve()
    return ExecutorCore(config), build_scheduler(config)


def main(argv: list[str] | None = None) -> int:
    args = in_process_parser(__doc__).parse_args(argv)
    core, sched = in_process_engine(args, enforce_eager=False, compile_batch_sizes=(1,))
    layouts = _Layouts(core.model)
    results = {"arena": {"linear_s": [], "step_s": [], "tokens": None},
               "plain": {"linear_s": [], "step_s": [], "tokens": None}}
    weight_bytes = _linears_s(core.model)[1]
    with torch.inference_mode():
        for layout in results:  # warm both
            layouts.use(layout)
            decode_steps(core, sched, f"warm-{layout}", 16)
            _linears_s(core.model)
        for round_ in range(args.rounds):
            for layout in (("arena", "plain") if round_ % 2 == 0 else ("plain", "arena")):
                layouts.use(layout)
                row = results[layout]
                for _ in range(20):
                    row["linear_s"].append(_linears_s(core.model)[0])
                step_s, tokens = decode_steps(core, sched, f"r{round_}-{layout}", args.tokens)
                row["step_s"].extend(step_s)
                row["tokens"] = row["tokens"] or tokens
    layouts.use("arena")
    print(f"threads {args.threads}, {args.rounds} rounds, {weight_bytes / 1e6:.1f} MB of float32 linears"
          + ("" if weight_bytes else " (packed weights: the decode step only)"))
    print(f"{'layout':8} {'linears ms':>11} {'GB/s':>6} {'decode step ms':>15} {'tok/s':>7}")
    for layout, row in results.items():
        linear = statistics.median(row["linear_s"])
        step = statistics.median(row["step_s"])
        linears = f"{linear * 1e3:11.3f} {weight_bytes / linear / 1e9:6.1f}" if weight_bytes else f"{'-':>11} {'-':>6}"
        print(f"{layout:8} {linears} {step * 1e3:15.3f} {1 / step:7.1f}")
    ratio = statistics.median(results["plain"]["step_s"]) / statistics.median(results["arena"]["step_s"])
    same = results["arena"]["tokens"] == results["plain"]["tokens"]
    print(f"arena / plain decode speed: {ratio:.3f}x; greedy tokens identical: {same}")
    return 0
