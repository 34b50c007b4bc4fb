"""Compiled decode: Inductor's C++ wrapper vs its Python wrapper, in one run; see
trillium/benchmarks/graph_wrapper.py.

Run: .venv/bin/python bench/graph_wrapper.py [--rounds 8] [--tokens 128] [--model DIR]
"""

from trillium.benchmarks.graph_wrapper import main

if __name__ == "__main__":
    raise SystemExit(main())
