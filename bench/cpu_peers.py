"""Trillium beside llama.cpp's llama-server and vLLM's CPU build, one server at a time; see
trillium/benchmarks/cpu_peers.py.

Run: .venv/bin/python bench/cpu_peers.py --llama-server PATH --vllm-python PATH [--rounds 3] [--save-result F.json]
"""

from trillium.benchmarks.cpu_peers import main

if __name__ == "__main__":
    raise SystemExit(main())
