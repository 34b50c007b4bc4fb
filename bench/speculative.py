"""Speculative decoding (ngram) vs none: batch 1 and 8, repetition-heavy and free
generation; tok/s, ITL, acceptance; see trillium/benchmarks/speculative.py.

Run: .venv/bin/python bench/speculative.py [--model PATH] [--device cuda] [--max-tokens 96]
"""

from trillium.benchmarks.speculative import main

if __name__ == "__main__":
    raise SystemExit(main())
