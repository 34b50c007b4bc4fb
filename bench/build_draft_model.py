"""Distil a small draft model from the target for `bench/speculative.py --draft`; see
trillium/benchmarks/draft_distill.py.

Run: .venv/bin/python bench/build_draft_model.py OUT [--model TARGET] [--steps 1500] [--samples 3]
"""

from trillium.benchmarks.draft_distill import main

if __name__ == "__main__":
    raise SystemExit(main())
