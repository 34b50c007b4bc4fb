"""Unstreamed requests (final-only outputs) against an earlier revision, both servers up together.

See trillium/benchmarks/final_only.py.
Run: .venv/bin/python bench/final_only.py --against REV [--concurrency C] [--server-arg=--num-scheduler-steps=16]
"""

from trillium.benchmarks.final_only import main

if __name__ == "__main__":
    raise SystemExit(main())
