"""A batch of chat requests with one system prompt, admitted in one step: prefill tokens computed and TTFT.

Run: .venv/bin/python bench/shared_prompt.py [--requests 16] [--system-tokens 512] [--user-tokens 16]
     [--rounds 3] [--threads N]

Checkpoint: the bench backbone as a LlamaForCausalLM (`bench`: hidden 512, 8 layers, vocab 8192),
built into a temporary folder (trillium/models/synthetic.py; nothing downloaded). Every request is the
same system prompt followed by its own user turn (token ids), max_tokens 1, all submitted in one
`LLM.generate` call with a step budget that holds them all, so they are admitted in the same step.
Same-step prefix sharing (scheduler/step_plan.py) computes the system prompt once; without it each
request computes it. Printed per pass (each from an empty prefix cache; the best of --rounds kept):
the prompt tokens computed (queries - prefix-cache hits, from the engine's stats) and the time to
the first tokens (the call's wall time: they all come from one step). Figures are printed, never
asserted; the machine may be shared (the load average is printed). Compare trees by running this
script with each tree first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from trillium import LLM, SamplingParams
from trillium.actors.protocol.admin import ResetPrefixCache
from trillium.models.synthetic import build_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=512, help="the shared system prompt's length")
    parser.add_argument("--user-tokens", type=int, default=16, help="each request's own tokens after it")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes; the best is kept")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    system = rng.integers(10, 8000, args.system_tokens).tolist()
    prompts = [{"prompt_token_ids": system + rng.integers(10, 8000, args.user_tokens).tolist()}
               for _ in range(args.requests)]
    step_tokens = args.requests * (args.system_tokens + args.user_tokens)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        path = build_checkpoint(Path(root) / "bench", "bench")
        with LLM(str(path), max_num_seqs=args.requests, max_num_batched_tokens=step_tokens,
                 max_model_len=args.system_tokens + args.user_tokens + 8, kv_cache_memory="1GiB",
                 enforce_eager=True) as llm:  # WHY eager: prefill only; compiled decode only slows the start
            llm.generate(prompts[:1], params)  # warm-up
            passes = []
            for i in range(args.rounds):
                reply = llm._call(llm._client.control, ResetPrefixCache(f"bench-{i}"))
                assert reply.status == 200, reply.message
                before = llm.get_stats()
                start = time.perf_counter()
                llm.generate(prompts, params)
                seconds = time.perf_counter() - start
                time.sleep(0.5)  # WHY: the stats of the last step arrive just after its outputs
                after = llm.get_stats()
                computed = ((after.prefix_cache_queries_total - before.prefix_cache_queries_total)
                            - (after.prefix_cache_hits_total - before.prefix_cache_hits_total))
                passes.append((seconds, computed))
    seconds, computed = min(passes)
    print(f"{args.requests} requests x ({args.system_tokens} shared + {args.user_tokens} own) tokens, one step; "
          f"torch threads {torch.get_num_threads()}; best of {args.rounds}; load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"prompt tokens computed {computed} of {args.requests * (args.system_tokens + args.user_tokens)}; "
          f"time to first tokens {seconds * 1e3:.0f} ms (passes: {', '.join(f'{s * 1e3:.0f}' for s, _ in passes)})")


if __name__ == "__main__":
    main()
