"""LoRA adapters for the tests: PEFT adapters on disk, in-memory random adapters, peft's greedy tokens.

`ADAPTERS` are three PEFT configurations for the synthetic Llama checkpoint
(hidden 64, 2 layers):

    attn   r=8,  alpha=16, q/k/v/o_proj
    mlp    r=4,  alpha=8,  gate/up/down_proj
    all    r=16, alpha=12, all seven, rsLoRA

`make_peft_adapter` saves one with random non-zero weights, `copy_adapter`
copies one with its config edited (for the validation errors),
`random_adapter` builds a `LoRAAdapter` without peft, and `peft_greedy` is
the oracle: transformers (+ peft with the adapter) greedy tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from support.oracles import hf_greedy
from support.paged_runner import load_hf
from trillium.lora import LoRAAdapter, LoRAWeights
from trillium.lora.adapter import module_dims

ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(
        r=16,
        lora_alpha=12,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
}


def make_peft_adapter(base_path: Path, out_dir: Path, seed: int, **lora_kwargs) -> Path:
    """Random non-zero LoRA weights (init_lora_weights=False), saved as safetensors."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_hf(base_path), LoraConfig(init_lora_weights=False, **lora_kwargs))
    model.save_pretrained(str(out_dir))
    return out_dir


def copy_adapter(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config_file = dst / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(config_changes)
    config_file.write_text(json.dumps(config))
    return dst


def random_adapter(config, modules, rank, scaling=0.5, layers=(0, 1), seed=0) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    dims = module_dims(config)
    weights = {
        (layer, m): LoRAWeights(
            a=torch.randn(rank, dims[m][0], generator=gen), b=torch.randn(dims[m][1], rank, generator=gen)
        )
        for layer in layers
        for m in modules
    }
    return LoRAAdapter(path=f"mem://{seed}", rank=rank, lora_alpha=scaling * rank, use_rslora=False,
                       scaling=scaling, weights=weights)  # fmt: skip


def peft_greedy(base, adapter_dir, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers on `base` (+ the peft adapter in `adapter_dir`, if not None)."""
    model = load_hf(base)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    return [hf_greedy(model, prompt, max_tokens)[0] for prompt in prompts]
