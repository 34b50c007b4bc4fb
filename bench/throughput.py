"""Engine throughput vs Hugging Face generate and a bare decode loop.

Same as `trillium bench throughput`; see trillium/benchmarks/throughput.py.
Run: .venv/bin/python bench/throughput.py [--repeats 3] [--workloads mixed,decode]
     .venv/bin/python bench/throughput.py --tracing   (tracing off / on / detailed)
"""

from trillium.benchmarks.throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
