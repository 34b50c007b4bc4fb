"""--stream-interval and --num-scheduler-steps flag sets, one trillium serve at a time, alternated.

See trillium/benchmarks/stream_interval.py.
Run: .venv/bin/python bench/stream_interval.py [--passes 2] [--all-at-once] [--config "LABEL=FLAGS" ...]
"""

from trillium.benchmarks.stream_interval import main

if __name__ == "__main__":
    raise SystemExit(main())
