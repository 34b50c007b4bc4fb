"""Multi-LoRA throughput: the mixed workload over 4 adapters vs the base model, in one run.

Same requests as `trillium bench throughput`'s mixed workload (64 requests,
prompts U[32, 512], outputs U[16, 256], ignore_eos) on the benchmark model,
run by one engine built with `enable_lora=True, max_loras=4`:

    base    every request on the base model
    4 LoRA  request i on adapter i % 4 (rank 16, all seven projections,
            random non-zero PEFT weights written by this script)

Prints output tokens/s (median of --repeats) and the ratio. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: str, model_config, rank: int, seed: int) -> str:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), random A and B."""
    from safetensors.torch import save_file

    from trillium.lora.adapter import module_dims

    os.makedirs(path, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module, (in_features, out_features) in module_dims(model_config).items():
            group = "self_attn" if module in MODULES[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
                   "bias": "none", "use_rslora": False}, f)
    return path


def _run(llm, reqs, loras) -> float:
    from trillium import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, lora=loras)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(o for _, o in reqs), "engine produced the wrong number of tokens"
    return produced / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/lora.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--model-dir", default=None, help="benchmark model (default: built in a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from trillium import LLM, LoRARequest
    from trillium.benchmarks.throughput import _workload_mixed
    from trillium.models.loader import load_model_config
    from trillium.models.synthetic import build_checkpoint

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "trillium-bench-model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_checkpoint(model_dir, "bench", seed=0)
    config = load_model_config(model_dir)
    adapter_root = tempfile.mkdtemp(prefix="trillium-bench-lora-")
    adapters = [LoRARequest(f"adapter-{i}", write_adapter(os.path.join(adapter_root, f"a{i}"), config,
                                                          args.rank, seed=i))
                for i in range(args.num_adapters)]
    llm = LLM(model_dir, max_num_seqs=64, max_num_batched_tokens=1024, kv_cache_memory="1GiB",
              enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
    base, lora = [], []
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * len(adapters), lora=adapters)  # load + warm up
        for r in tqdm(range(args.repeats), desc="repeats"):
            # WHY a fresh seed per run: repeats must not hit the prefix cache.
            reqs = _workload_mixed(config.vocab_size, args.seed + 1000 * r)
            base.append(_run(llm, reqs, None))
            reqs = _workload_mixed(config.vocab_size, args.seed + 1000 * r + 500)
            lora.append(_run(llm, reqs, [adapters[i % len(adapters)] for i in range(len(reqs))]))
    finally:
        llm.shutdown()
    b, lo = statistics.median(base), statistics.median(lora)
    print()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats} runs; "
          f"{args.num_adapters} adapters of rank {args.rank} on all seven projections, max_loras "
          f"{args.num_adapters}")
    print(f"{'workload':<28}{'tok/s':>10}{'vs base':>10}")
    print(f"{'mixed, base model':<28}{b:>10.1f}{1.0:>10.2f}")
    print(f"{f'mixed, {args.num_adapters} LoRA adapters':<28}{lo:>10.1f}{lo / b:>10.2f}")
    return 0
