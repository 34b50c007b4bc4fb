"""Compiled decode vs eager on the bench model, side by side in one run.

See trillium/benchmarks/compiled_decode.py.
Run: .venv/bin/python bench/compiled_decode.py [--rounds 3] [--streams 8] [--cold-warm]
"""

from trillium.benchmarks.compiled_decode import main

if __name__ == "__main__":
    raise SystemExit(main())
