"""CPU decode attention, gather vs paged, side by side in one run (`bench/paged_decode_attention.py`).

Two modes, interleaved round by round so a loaded machine hurts both alike:

  gather   TRILLIUM_KERNELS=reference: `reference.paged_attention` gathers
           each sequence's blocks into a dense copy, then SDPA
  paged    the C kernel (`kernels/paged_attention_cpu.c`) reads the blocks
           where they lie

Per layer call: decode attention alone at the bench model's shape (8 / 4
heads, head dim 64, block 16, float32 and fp8 e4m3 caches), batch 1 and 16,
context 128 and 512, a fresh metadata per simulated step of 8 layers (the
gather plan is built once per step, as in the engine); microseconds per
call, the fastest step of all rounds (on a loaded machine the fastest is the
least disturbed) and the median.

Against a revision (`--against REV`): the float32 kernel against the same file at git revision REV
(trillium/benchmarks/revisions.py), 1 row (one stream) and 16 and 64 rows (a served batch of long
requests) of ~400 keys with a cache of their own per layer (8 layers: the 16- and 64-row batches
hold more than the caches do), ms per forward of 8
layers and the KV bytes per second read, medians of alternated rounds, and whether the two builds'
outputs are the same bits.

KV pages (`--kv-pages`): the same kernel over the same float32 caches (1, 16 and 64 rows of ~400
keys, a cache per layer) on 4 KB pages and on 2 MB pages (`weight_arena.huge_page_zeros`, as the
engine allocates its CPU caches), alternated; ms per forward of 8 layers, medians.

End to end: one in-process engine on the `bench` model (compiled decode at
buckets 1 and 16 unless --enforce-eager), the mode flipped between rounds
(the switch is read per call): single stream (128-token prompt, 128 greedy
tokens, ITL = (e2e - TTFT) / 127) and 16 streams (ITL = (e2e - the same
prompts' prefill) / 127). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import tempfile
import time

import torch

from trillium.kernels import AttentionMetadata, paged_attention_cpu, reference
from trillium.kernels.fp8 import quantize_fp8

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 8, 4, 64, 16, 8
MODES = ("gather", "paged")


def _set_mode(mode: str) -> None:
    if mode == "gather":
        os.environ["TRILLIUM_KERNELS"] = "reference"
    else:
        os.environ.pop("TRILLIUM_KERNELS", None)


def _step_inputs(batch: int, context: int, dtype: torch.dtype, rng: random.Random):
    """(q, k_cache, v_cache, scales, table, lengths) for one decode batch, lengths around `context`."""
    lens = [max(1, context + rng.randrange(-context // 4, context // 4 + 1)) for _ in range(batch)]
    blocks = [-(-n // BLOCK) for n in lens]
    ids = list(range(1, sum(blocks) + 1))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in blocks:
        tables.append(ids[at : at + n])
        at += n
    shape = (sum(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape), torch.randn(shape)
    scales = (None, None)
    if dtype != torch.float32:
        scales = (torch.tensor(0.125), torch.tensor(0.125))
        k, v = quantize_fp8(k, scales[0], dtype), quantize_fp8(v, scales[1], dtype)
    return torch.randn(batch, HEADS, HEAD_DIM), k, v, scales, tables, lens


def _per_call_us(mode: str, inputs, steps: int) -> float:
    q, k, v, (ks, vs), tables, lens = inputs
    fn = reference.paged_attention if mode == "gather" else paged_attention_cpu.decode_attention
    times = []
    for _ in range(steps):
        meta = AttentionMetadata.build([1] * len(lens), lens, tables, BLOCK)  # a new step: a new plan
        start = time.perf_counter()
        for _ in range(LAYERS):
            fn(q, k, v, meta, HEAD_DIM**-0.5, ks, vs)
        times.append((time.perf_counter() - start) / LAYERS * 1e6)
    return times


def against(rev: str, rounds: int) -> None:
    from trillium.benchmarks.revisions import library_at, using

    try:
        old = library_at(paged_attention_cpu, rev)
    except RuntimeError as exc:
        print(f"\n--against {rev}: {exc}")
        return
    rng = random.Random(1)
    print(f"\nfloat32, a cache per layer (ms per forward of {LAYERS} layers, KV GB/s): "
          f"this tree against {rev}")
    print(f"{'batch':>6}{'ctx':>6}{'this ms':>10}{'GB/s':>7}{rev[:10]:>12}{'GB/s':>7}{'speed-up':>9}  same bits")
    for batch in (1, 16, 64):
        q, _, _, _, tables, lens = _step_inputs(batch, 400, torch.float32, rng)
        blocks = sum(len(t) for t in tables) + 1
        caches = [(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM), torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM))
                  for _ in range(LAYERS)]
        meta = AttentionMetadata.build([1] * batch, lens, tables, BLOCK)
        nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 4 * 2 * LAYERS
        outs = {}

        def run(name: str) -> float:
            with contextlib.ExitStack() as stack:
                if name == rev:
                    stack.enter_context(using(paged_attention_cpu, old))
                outs[name] = paged_attention_cpu.decode_attention(q, *caches[0], meta, HEAD_DIM**-0.5)
                return _forward_s(q, caches, meta)

        new, base = _alternated_medians(run, ("this", rev), rounds)
        print(f"{batch:>6}{400:>6}{new * 1e3:>10.2f}{nbytes / new / 1e9:>7.1f}{base * 1e3:>12.2f}"
              f"{nbytes / base / 1e9:>7.1f}{base / new:>8.2f}x  {torch.equal(outs['this'], outs[rev])}")


def _alternated_medians(run, names: tuple[str, str], rounds: int) -> tuple[float, float]:
    """Median seconds of run(name) for each of the two names, over rounds * 2 alternations, each
    name first in turn (a machine whose speed drifts meets both alike)."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds * 2):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            times[name].append(run(name))
    return statistics.median(times[names[0]]), statistics.median(times[names[1]])


def _forward_s(q: torch.Tensor, caches, meta) -> float:
    """Seconds of one forward's attention (the kernel over every layer's cache), averaged over several
    (50 for one row, whose forward is ~0.3 ms; 5 otherwise)."""
    repeats = 50 if q.shape[0] == 1 else 5
    start = time.perf_counter()
    for _ in range(repeats):
        for k, v in caches:
            paged_attention_cpu.decode_attention(q, k, v, meta, HEAD_DIM**-0.5)
    return (time.perf_counter() - start) / repeats


def kv_pages(rounds: int) -> None:
    """The same kernel over the same float32 caches on 4 KB pages (torch.randn) and on 2 MB pages (a copy
    in weight_arena.huge_page_zeros, as the engine allocates them), alternated."""
    from trillium.models.weight_arena import HUGE_PAGE_BYTES, _huge_bytes, _thp_mode, huge_page_zeros

    rng = random.Random(2)
    print(f"\nfloat32 KV caches on 4 KB against 2 MB pages, a cache per layer (ms per forward of {LAYERS} layers; "
          f"THP {_thp_mode() or 'unknown'}; MB on huge pages as /proc/self/smaps counts them)")
    print(f"{'batch':>6}{'ctx':>6}{'4 KB ms':>10}{'2 MB ms':>10}{'speed-up':>9}{'huge MB':>16}")
    for batch in (1, 16, 64):
        q, _, _, _, tables, lens = _step_inputs(batch, 400, torch.float32, rng)
        block_bytes = BLOCK * KV_HEADS * HEAD_DIM * 4  # a pool of at least 2 MB a cache, as the engine's
        blocks = max(sum(len(t) for t in tables) + 1, -(-HUGE_PAGE_BYTES // block_bytes))
        shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
        small = [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)]
        huge = [(huge_page_zeros(shape, torch.float32).copy_(k), huge_page_zeros(shape, torch.float32).copy_(v))
                for k, v in small]
        meta = AttentionMetadata.build([1] * batch, lens, tables, BLOCK)
        plain, advised = _alternated_medians(lambda name: _forward_s(q, small if name == "4 KB" else huge, meta),
                                             ("4 KB", "2 MB"), rounds)
        huge_mb = [sum(_huge_bytes(t.data_ptr()) for pair in side for t in pair) / 1e6 for side in (small, huge)]
        print(f"{batch:>6}{400:>6}{plain * 1e3:>10.2f}{advised * 1e3:>10.2f}{plain / advised:>8.2f}x"
              f"{huge_mb[0]:>7.0f} / {huge_mb[1]:<6.0f}")


def micro(rounds: int, steps: int) -> None:
    rng = random.Random(0)
    print(f"\nper layer call, us ({HEADS}/{KV_HEADS} heads, D {HEAD_DIM}, block {BLOCK}, "
          f"{torch.get_num_threads()} threads)")  # fmt: skip
    print(f"{'cache':<10}{'batch':>6}{'ctx':>6}{'gather min':>12}{'paged min':>12}{'ratio':>7}"
          f"{'gather med':>12}{'paged med':>12}{'ratio':>7}")  # fmt: skip
    for dtype in (torch.float32, torch.float8_e4m3fn):
        for batch in (1, 16):
            for context in (128, 512):
                inputs = _step_inputs(batch, context, dtype, rng)
                got = {m: [] for m in MODES}
                for _ in range(rounds):
                    for mode in MODES:
                        got[mode].extend(_per_call_us(mode, inputs, steps))
                (g_min, p_min), (g_med, p_med) = ([f(got[m]) for m in MODES] for f in (min, statistics.median))
                name = "float32" if dtype == torch.float32 else "fp8_e4m3"
                print(f"{name:<10}{batch:>6}{context:>6}{g_min:>12.1f}{p_min:>12.1f}{g_min / p_min:>7.2f}"
                      f"{g_med:>12.1f}{p_med:>12.1f}{g_med / p_med:>7.2f}")


def _generate_s(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from trillium import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return time.perf_counter() - start


def _itl_ms(llm, rng: random.Random, streams: int) -> float:
    prompts = [[rng.randrange(4, 8192) for _ in range(128)] for _ in range(streams)]
    first = _generate_s(llm, [p[:-1] + [rng.randrange(4, 8192)] for p in prompts], 1)  # prefill, not cached
    return (_generate_s(llm, prompts, 128) - first) / 127 * 1e3


def end_to_end(rounds: int, eager: bool, model_dir: str) -> None:
    from trillium import LLM
    from trillium.models.synthetic import build_checkpoint

    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_checkpoint(model_dir, "bench", seed=0)
    llm = LLM(model_dir, max_num_seqs=64, kv_cache_memory="256MiB", enforce_eager=eager, compile_batch_sizes=(1, 16))
    got = {(m, s): [] for m in MODES for s in (1, 16)}
    try:
        for mode in MODES:  # warm-up (and the kernel's build)
            _set_mode(mode)
            _itl_ms(llm, random.Random(-1), 1)
        for r in range(rounds):
            for mode in MODES:
                _set_mode(mode)
                for streams in (1, 16):
                    got[mode, streams].append(_itl_ms(llm, random.Random(r * 100 + streams), streams))
    finally:
        _set_mode("paged")
        llm.shutdown()
    print(f"\nend to end, bench model ({'eager' if eager else 'compiled decode, buckets 1,16'}), "
          f"median ITL ms of {rounds} interleaved rounds")  # fmt: skip
    print(f"{'streams':<10}{'gather':>10}{'paged':>10}{'ratio':>8}")
    for streams in (1, 16):
        gather, paged = (statistics.median(got[m, streams]) for m in MODES)
        print(f"{streams:<10}{gather:>10.2f}{paged:>10.2f}{gather / paged:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per mode (median reported)")
    parser.add_argument("--steps", type=int, default=20, help="simulated steps per micro-benchmark round")
    parser.add_argument("--enforce-eager", action="store_true", help="end to end without compiled decode")
    parser.add_argument("--skip-e2e", action="store_true", help="only the per-call micro-benchmark")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "trillium-bench-model"),
                        help="the bench model (built there if missing)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default torch's")
    parser.add_argument("--against", default=None, metavar="REV",
                        help="also time 1, 16 and 64 rows against the kernel at git revision REV (e.g. HEAD~1)")
    parser.add_argument("--kv-pages", action="store_true",
                        help="also time float32 caches on 4 KB against 2 MB pages (1, 16 and 64 rows)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not paged_attention_cpu.available():
        print(f"the paged kernel is unavailable here: {paged_attention_cpu.unavailable_reason()}")
        return 1
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    micro(args.rounds, args.steps)
    if args.against:
        against(args.against, args.rounds)
    if args.kv_pages:
        kv_pages(args.rounds)
    if not args.skip_e2e:
        end_to_end(args.rounds, args.enforce_eager, args.model_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
