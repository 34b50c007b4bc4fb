"""Weights in one huge-page arena vs one allocation each, in one run; see trillium/benchmarks/weight_arena.py.

Run: .venv/bin/python bench/weight_arena.py [--rounds 8] [--tokens 128] [--model DIR]
"""

from trillium.benchmarks.weight_arena import main

if __name__ == "__main__":
    raise SystemExit(main())
