"""HTTP serving benchmark (same as `trillium bench serving`); see trillium/benchmarks/serving.py.

Run: .venv/bin/python bench/serving.py [--rate 2.0]
"""

from trillium.benchmarks.serving import main

if __name__ == "__main__":
    raise SystemExit(main())
