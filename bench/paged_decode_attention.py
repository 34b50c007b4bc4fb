"""CPU decode attention, gather vs paged (per layer call and end to end), side by side in one run.

See trillium/benchmarks/paged_decode_attention.py.
Run: .venv/bin/python bench/paged_decode_attention.py [--rounds 3] [--enforce-eager] [--skip-e2e] [--against REV] [--kv-pages]
"""

from trillium.benchmarks.paged_decode_attention import main

if __name__ == "__main__":
    raise SystemExit(main())
