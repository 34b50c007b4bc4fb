"""The EAGLE checkpoint: the format vLLM loads for `"method": "eagle"`, read and written.

A directory with config.json and *.safetensors, as the EAGLE-1 heads vLLM
serves (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B, converted to safetensors:
pickle files are refused, checkpoint_files.py). What vLLM reads
(vllm/model_executor/models/llama_eagle.py, EagleLlamaForCausalLM):

    config.json   a LlamaConfig; architectures LlamaForCausalLMEagle or
                  EagleLlamaForCausalLM; num_hidden_layers head layers (1)
    fc.weight     [hidden, 2 * hidden]: fc(cat(embed(token), hidden_state));
                  fc.bias optional (EAGLE's own training code has one)
    layers.{i}.*  Llama decoder layers with HF names (q/k/v/o_proj,
                  gate/up/down_proj, post_attention_layernorm); layer 0 has
                  no input_layernorm (EAGLE feeds fc's output straight in)
    embed_tokens.weight, lm_head.weight  ignored when present: the head
                  shares the target's (vLLM does so for EAGLE-1 without
                  pipeline parallelism, vllm/v1/spec_decode/eagle.py)

Names may carry a "model." prefix (vLLM adds it on load). Refused by name at
start-up: EAGLE-3 (Eagle3LlamaForCausalLM, LlamaForCausalLMEagle3: it reads
aux hidden states of three target layers), HASS's `add_para_norm`, a head
whose hidden size or vocabulary differs from the target's, unknown tensors.

`write_checkpoint` writes the same format (tests and the bench build heads
with it; eagle_training.py trains them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trillium.models.checkpoint_files import safetensors_files
from trillium.models.config import ModelConfig, dtype_name

ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
_EAGLE3 = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3Speculator")
_SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's are used


def read_config(path: str | Path) -> ModelConfig:
    """The head's ModelConfig from its config.json; ValueError names what is not supported."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise ValueError(f"--speculative-config model {path}: no config.json (an EAGLE checkpoint directory)")
    hf = json.loads(file.read_text())
    archs = hf.get("architectures") or []
    if any(a in _EAGLE3 for a in archs) or "eagle_aux_hidden_state_layer_ids" in hf or "draft_vocab_size" in hf:
        raise ValueError(f"--speculative-config model {path} is an EAGLE-3 head ({archs}); "
                         "Trillium implements EAGLE-1 heads (method eagle) only")
    if not archs or archs[0] not in ARCHITECTURES:
        raise ValueError(f"--speculative-config model {path}: architectures {archs} is not an EAGLE head; "
                         f"expected one of {list(ARCHITECTURES)}")
    if hf.get("add_para_norm"):
        raise ValueError(f"--speculative-config model {path}: add_para_norm (HASS heads) is not supported")
    return ModelConfig.from_hf_config({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def check_against_target(head: ModelConfig, target: ModelConfig, path: str | Path) -> None:
    """The head reads the target's hidden states and shares its embedding and LM head."""
    for field in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(head, field), getattr(target, field)
        if mine != theirs:
            raise ValueError(f"--speculative-config model {path}: the EAGLE head's {field} {mine} "
                             f"differs from the target's {theirs}")
    if head.num_layers < 1:
        raise ValueError(f"--speculative-config model {path}: num_hidden_layers must be >= 1")


def expected_shapes(config: ModelConfig, fc_bias: bool) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the head reads."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, 2 * h)}
    if fc_bias:
        shapes["fc.bias"] = (h,)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        if i > 0:
            shapes[p + "input_layernorm.weight"] = (h,)
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    return shapes


def read_weights(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The head's tensors by HF name (no "model." prefix), shapes checked; shared ones dropped."""
    found: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                bare = name.removeprefix("model.")
                if bare in _SHARED or bare == "layers.0.input_layernorm.weight":
                    continue  # shared with the target / unused (vLLM: nn.Identity)
                found[bare] = f.get_tensor(name)
    shapes = expected_shapes(config, "fc.bias" in found)
    unknown = sorted(set(found) - set(shapes))
    if unknown:
        raise ValueError(f"EAGLE checkpoint {path}: unsupported tensor(s) {unknown[:4]}")
    missing = sorted(set(shapes) - set(found))
    if missing:
        raise ValueError(f"EAGLE checkpoint {path}: missing tensor(s) {missing[:4]}")
    for name, shape in shapes.items():
        if tuple(found[name].shape) != shape:
            raise ValueError(f"EAGLE checkpoint {path}: {name} has shape {tuple(found[name].shape)}, expected {shape}")
    return found


def head_config_dict(target: ModelConfig, num_layers: int = 1) -> dict:
    """config.json of a head for a target: the target's widths and rope, `num_layers` layers."""
    config = {
        "vocab_size": target.vocab_size, "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size, "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim,
        "max_position_embeddings": target.max_position_embeddings, "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta, "hidden_act": "silu", "bos_token_id": target.bos_token_id,
        "eos_token_id": list(target.eos_token_ids),
    }
    if target.rope_scaling:
        config["rope_scaling"] = dict(target.rope_scaling)
    return {**config, "architectures": [ARCHITECTURES[0]], "model_type": "llama", "num_hidden_layers": num_layers,
            "tie_word_embeddings": False}


def write_checkpoint(path: str | Path, config: dict, weights: dict[str, torch.Tensor],
                     embed_tokens: torch.Tensor | None = None) -> Path:
    """config.json + model.safetensors in vLLM's EAGLE format (HF names; the
    target's embedding copied in as EAGLE checkpoints carry it, if given)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in weights.items()}
    if embed_tokens is not None:
        tensors["embed_tokens.weight"] = embed_tokens.detach().contiguous().cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    dtype = dtype_name(next(iter(tensors.values())).dtype)
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2) + "\n")
    return path


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the head's KV per cached token (every head layer's keys and values)."""
    return config.num_layers * 2 * config.kv_size * torch.empty((), dtype=dtype).element_size()
