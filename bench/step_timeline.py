"""Per-step timeline (same as `trillium bench timeline`); see trillium/benchmarks/timeline.py.

Run: .venv/bin/python bench/step_timeline.py [--batches 1,16,64] [--window-s 3]
"""

from trillium.benchmarks.timeline import main

if __name__ == "__main__":
    raise SystemExit(main())
