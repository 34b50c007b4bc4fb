"""Pooling throughput: embeddings/s and rerank pairs/s, Trillium beside transformers in one run.

Run: .venv/bin/python bench/pooling.py [--num-inputs 64] [--batch-size 32] [--max-num-seqs 256]
     [--rounds 3] [--threads N] [--only embed|rerank] [--lengths short,long,mixed] [--query-tokens 12]

Checkpoints: the bench backbone (hidden 512, 8 layers, vocab 8192) built as
`bench-embed` (LlamaModel, last-token pooling, normalized) and
`bench-rerank` (LlamaForSequenceClassification, one label: a cross-encoder),
into a temporary folder (trillium/models/synthetic.py; nothing downloaded).
Inputs: windows of the built-in corpus, "short" ~16 tokens, "long" ~384, and
"mixed": lengths drawn uniformly from 16 to 512 tokens, in arrival order (rerank:
a query (--query-tokens) + a document of that size, one prompt per pair).

Trillium: `LLM.embed` / `LLM.score` (every input one engine request through
the scheduler: up to --max-num-seqs requests and --step-tokens tokens a step,
no padding, chunk-prefilled, prefix-cached; a rerank's query prefix is shared
by its pairs). transformers: the same checkpoint in float32, batches of
--batch-size in arrival order, padded right with an attention mask, pooled at
each row's last real token (embeddings) or through its classifier (whose
pad-aware last-token pick is transformers' own). After one warm-up call,
--rounds timed passes, the two sides alternating (Trillium's each from an
empty prefix cache), and the best pass of each is kept (the machine may be
shared: the load average is printed). The figures are printed, never
asserted; both sides also agree on the outputs (max |difference|).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from trillium import LLM
from trillium.actors.protocol.admin import ResetPrefixCache
from trillium.models.synthetic import build_checkpoint
from trillium.models.synthetic_corpus import CORPUS
from trillium.models.tokenizer import load_tokenizer


def windows(tokenizer, count: int, length: int | tuple[int, int], seed: int) -> list[str]:
    """`count` corpus windows of about `length` tokens (a (low, high) pair: drawn uniformly)."""
    words = CORPUS.split()
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(count):
        size = length if isinstance(length, int) else int(rng.integers(length[0], length[1] + 1))
        start = int(rng.integers(0, max(1, len(words) - size)))
        chunk = (words * (2 + size // len(words)))[start : start + int(size * 0.75)]
        texts.append(" ".join(chunk))
    return texts


def reset_prefix_cache(llm: LLM) -> None:
    """Empty the engine's prefix cache, so a pass never reads the previous pass's blocks."""
    reply = llm._call(llm._client.control, ResetPrefixCache(f"bench-{time.monotonic_ns()}"))
    if reply.status != 200:
        raise RuntimeError(f"reset_prefix_cache: {reply.status} {reply.message}")


def best_of(rounds: int, llm: LLM, ours, ref) -> tuple:
    """(our result, our best seconds, their result, their best seconds), passes alternating;
    each of ours starts from an empty prefix cache (hits inside a pass still count)."""
    ours_s, ref_s = [], []
    for _ in range(rounds):
        reset_prefix_cache(llm)
        mine, seconds = timed(ours)
        ours_s.append(seconds)
        theirs, seconds = timed(ref)
        ref_s.append(seconds)
    return mine, min(ours_s), theirs, min(ref_s)


@torch.inference_mode()
def hf_embed(model, tokenizer, texts: list[str], batch_size: int) -> np.ndarray:
    out = []
    for i in range(0, len(texts), batch_size):
        ids = [tokenizer.encode(t) for t in texts[i : i + batch_size]]
        width = max(map(len, ids))
        batch = torch.tensor([x + [0] * (width - len(x)) for x in ids])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        hidden = model(input_ids=batch, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(ids)), mask.sum(1) - 1]
        out.append(torch.nn.functional.normalize(last, dim=-1).numpy())
    return np.concatenate(out)


@torch.inference_mode()
def hf_rerank(model, tokenizer, pairs: list[tuple[str, str]], batch_size: int) -> np.ndarray:
    out = []
    for i in range(0, len(pairs), batch_size):
        ids = [tokenizer.encode_pair(a, b) for a, b in pairs[i : i + batch_size]]
        width = max(map(len, ids))
        batch = torch.tensor([x + [0] * (width - len(x)) for x in ids])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        out.append(torch.sigmoid(model(input_ids=batch, attention_mask=mask).logits[:, 0]).numpy())
    return np.concatenate(out)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def bench_embed(path: Path, args, lengths) -> list[tuple]:
    from transformers import AutoModel

    tokenizer = load_tokenizer(path)
    hf = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    rows = []
    with LLM(str(path), max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.step_tokens,
             kv_cache_memory="1GiB", device=args.device) as llm:
        for name, length in lengths:
            texts = windows(tokenizer, args.num_inputs, length, seed=sum(map(ord, name)))
            llm.embed(texts[:2])
            hf_embed(hf, tokenizer, texts[:2], args.batch_size)
            ours, ours_s, ref, ref_s = best_of(
                args.rounds, llm, lambda: np.array([o.outputs.embedding for o in llm.embed(texts)]),
                lambda: hf_embed(hf, tokenizer, texts, args.batch_size))
            num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
            rows.append(("embed", name, num_tokens / len(texts), len(texts) / ours_s, len(texts) / ref_s,
                         float(np.abs(ours - ref).max())))
    return rows


def bench_rerank(path: Path, args, lengths) -> list[tuple]:
    from transformers import AutoModelForSequenceClassification

    tokenizer = load_tokenizer(path)
    hf = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    rows = []
    with LLM(str(path), max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.step_tokens,
             kv_cache_memory="1GiB", device=args.device) as llm:
        for name, length in lengths:
            query = windows(tokenizer, 1, args.query_tokens, seed=1)[0]
            docs = windows(tokenizer, args.num_inputs, length, seed=sum(map(ord, name)) + 1)
            llm.score(query, docs[:2])
            hf_rerank(hf, tokenizer, [(query, d) for d in docs[:2]], args.batch_size)
            ours, ours_s, ref, ref_s = best_of(
                args.rounds, llm, lambda: np.array([o.outputs.score for o in llm.score(query, docs)]),
                lambda: hf_rerank(hf, tokenizer, [(query, d) for d in docs], args.batch_size))
            num_tokens = sum(len(tokenizer.encode_pair(query, d)) for d in docs)
            rows.append(("rerank", name, num_tokens / len(docs), len(docs) / ours_s, len(docs) / ref_s,
                         float(np.abs(ours - ref).max())))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-inputs", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="transformers' batch (padded)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="Trillium's --max-num-seqs: requests in one step (vLLM's default, 256)")
    parser.add_argument("--step-tokens", type=int, default=4096, help="Trillium's --max-num-batched-tokens")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes per side, alternating; the best is kept")
    parser.add_argument("--query-tokens", type=int, default=12,
                        help="rerank: about this many query tokens, shared by every pair (Qwen3-Reranker's template "
                             "puts its system prompt and instruction before the query: ~80 with them)")
    parser.add_argument("--only", choices=("embed", "rerank"), help="run one task only")
    parser.add_argument("--lengths", default="short,long,mixed",
                        help="comma-separated input rows to run, of short, long, mixed")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_by_name = {"short": 16, "long": 384, "mixed": (16, 512)}
    unknown = set(args.lengths.split(",")) - set(rows_by_name)
    if unknown:
        parser.error(f"--lengths: unknown {sorted(unknown)}; choose from {', '.join(rows_by_name)}")
    lengths = tuple((name, rows_by_name[name]) for name in args.lengths.split(","))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        rows = []
        if args.only != "rerank":
            rows += bench_embed(build_checkpoint(Path(root) / "embed", "bench-embed"), args, lengths)
        if args.only != "embed":
            rows += bench_rerank(build_checkpoint(Path(root) / "rerank", "bench-rerank"), args, lengths)
    print(f"{args.num_inputs} inputs per row; transformers batches of {args.batch_size}; Trillium up to "
          f"{args.max_num_seqs} requests / {args.step_tokens} tokens a step; torch threads {torch.get_num_threads()}; "
          f"rerank query ~{args.query_tokens} tokens; best of {args.rounds}; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print(f"{'task':<7} {'inputs':<6} {'tokens/input':>12} {'trillium/s':>11} {'transformers/s':>15} "
          f"{'speed-up':>9} {'max |diff|':>11}")
    for task, name, tokens, ours, ref, diff in rows:
        print(f"{task:<7} {name:<6} {tokens:>12.0f} {ours:>11.1f} {ref:>15.1f} {ours / ref:>8.2f}x {diff:>11.2e}")


if __name__ == "__main__":
    main()
