"""Multi-LoRA throughput vs the base model; see trillium/benchmarks/lora.py.
Run: .venv/bin/python bench/lora.py [--repeats 3] [--rank 16] [--num-adapters 4]
"""

from trillium.benchmarks.lora import main

if __name__ == "__main__":
    raise SystemExit(main())
