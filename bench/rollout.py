"""RL rollout benchmark (/generate vs /v1/completions, with weight pushes); see trillium/benchmarks/rollout.py.

Run: .venv/bin/python bench/rollout.py [--model-dir DIR] [--max-tokens 32] [--iterations 3]
"""

from trillium.benchmarks.rollout import main

if __name__ == "__main__":
    raise SystemExit(main())
