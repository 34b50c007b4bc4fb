"""The offline `LLM` on each model family: greedy tokens and top-5 logprobs equal transformers'.

A batch of mixed prompts (4..180 tokens, several sharing a 100-token prefix)
goes through the real actors with a 64-token step budget, so long prompts
prefill in chunks, far past every sliding window (16..32 tokens), and
decode with full and sliding layers side by side (Gemma). Oracle:
transformers' `generate` (support/oracles.py `hf_greedy`).

LoRA: PEFT adapters (peft installed) on the attention of an MoE model, on
Phi-3's fused qkv_proj / gate_up_proj and on Gemma 2 (gelu MLP, post-norms),
against peft's own greedy tokens;
adapters on an MoE model's MLP are refused, naming the model (vLLM's
Qwen2-MoE / Mixtral LoRA also leaves experts out: vllm-project/vllm
vllm/model_executor/models/qwen2_moe.py `packed_modules_mapping`).
"""

from __future__ import annotations

import json

import pytest

from support.llm_parity import assert_parity, mixed_prompts
from support.lora_adapters import make_peft_adapter, peft_greedy
from support.oracles import transformers_model
from trillium import LLM, LoRARequest, SamplingParams
from trillium.lora import AdapterError, load_adapter
from trillium.models.loader import load_model_config

FAMILIES = ["mistral-sliding", "phi3", "qwen2-moe", "qwen3-moe", "mixtral", "gemma2", "gemma3"]


@pytest.mark.parametrize("variant", FAMILIES)
def test_family_greedy_parity_with_transformers(checkpoint, variant):
    path = checkpoint(variant)
    hf_model = transformers_model(path)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=5, count=9)
    assert max(len(p) for p in prompts) > 64
    with LLM(str(path), max_num_batched_tokens=64, max_num_seqs=16) as llm:
        assert_parity(llm, hf_model, prompts, max_new=8)


@pytest.mark.parametrize(
    "variant, targets",
    [
        ("qwen3-moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),
        ("phi3", ["qkv_proj", "o_proj", "gate_up_proj"]),
        ("gemma2", ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
    ],
)
def test_lora_matches_peft(checkpoint, tmp_path, variant, targets):
    base = checkpoint(variant)
    adapter = make_peft_adapter(base, tmp_path / "adapter", seed=3, r=8, lora_alpha=16, target_modules=targets)
    prompts = [[5 + i, 17, 33, 90 + i, 12] * (1 + 3 * i) for i in range(3)]
    expected = peft_greedy(base, adapter, prompts, max_tokens=6)
    assert expected != peft_greedy(base, None, prompts, max_tokens=6), "the adapter must change the output"
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    with LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, max_num_batched_tokens=64) as llm:
        outputs = llm.generate(prompts, params, lora=LoRARequest("a", str(adapter)))
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("targets", [["gate_proj"], ["q_proj", "down_proj"], "all-linear", ".*mlp.*"])
def test_lora_on_moe_experts_is_refused(checkpoint, tmp_path, targets):
    base = checkpoint("qwen3-moe")
    adapter = make_peft_adapter(base, tmp_path / "adapter", seed=3, r=4, lora_alpha=8, target_modules=["q_proj"])
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["target_modules"] = targets
    config_file.write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="mixture-of-experts model Qwen3MoeForCausalLM is not supported"):
        load_adapter(adapter, load_model_config(base), max_rank=8)

