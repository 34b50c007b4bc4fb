"""--async-scheduling vs synchronous steps on the bench model, side by side in one run.

See trillium/benchmarks/async_scheduling.py.
Run: .venv/bin/python bench/async_scheduling.py [--rounds 3] [--streams 16] [--enforce-eager]
"""

from trillium.benchmarks.async_scheduling import main

if __name__ == "__main__":
    raise SystemExit(main())
