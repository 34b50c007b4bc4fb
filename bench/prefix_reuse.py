"""Multi-turn prefix reuse: tiers off, host tier, host + disk tier, side by side.

See trillium/benchmarks/prefix_reuse.py.
Run: .venv/bin/python bench/prefix_reuse.py [--conversations 32 --turns 6 --device-kv-tokens 4096]
"""

from trillium.benchmarks.prefix_reuse import main

if __name__ == "__main__":
    raise SystemExit(main())
