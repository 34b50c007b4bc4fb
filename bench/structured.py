"""Structured-output throughput (1/4 and all requests with a JSON schema) beside unconstrained,
and grammar compile time cold and cached; see trillium/benchmarks/structured.py.

Run: .venv/bin/python bench/structured.py [--repeats 3] [--num-requests 64]
"""

from trillium.benchmarks.structured import main

if __name__ == "__main__":
    raise SystemExit(main())
