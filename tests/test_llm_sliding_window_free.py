"""A sliding-window model whose requests outgrow the KV cache still runs, token for token as transformers.

The synthetic `mistral-sliding` checkpoint (every layer windowed, W = 24) on a
KV cache of 11 usable 4-token blocks (44 tokens) with a 16-token step budget:
without freeing, a 100-token request needs 25 blocks and is refused at once;
with the blocks behind the window freed (as vLLM's SlidingWindowManager,
vllm-project/vllm vllm/v1/core/single_type_kv_cache_manager.py) each request
holds at most ceil((24 - 1 + 16) / 4) + 1 = 11 blocks, so it runs. Two of them
at once cannot both keep their windows (7 blocks each while decoding): they
preempt each other (recompute) and still produce transformers' greedy tokens
(support/oracles.py `hf_greedy`) over ~4 windows, past chunked prefill.
"""

from __future__ import annotations

import random

from support.oracles import hf_greedy, transformers_model
from trillium import LLM, SamplingParams
from trillium.config import EngineConfig, uniform_sliding_window
from trillium.models.config import ModelConfig
from trillium.models.synthetic import hf_config_dict

MAX_NEW = 60
# 2 layers x (K + V) x 4 tokens x 2 KV heads x 16 dims x 4 bytes = 2 KiB a block: 12 blocks, one the NULL_BLOCK.
ENGINE = dict(block_size=4, kv_cache_memory="24KiB", max_num_batched_tokens=16, max_model_len=256)


def test_long_generations_on_a_cache_smaller_than_one_request(checkpoint):
    path = checkpoint("mistral-sliding")
    resolved = EngineConfig(model=str(path), **ENGINE).resolve()
    assert resolved.kv_sliding_window == 24 and resolved.num_blocks == 12
    rng = random.Random(7)
    prompts = [[rng.randrange(7, 512) for _ in range(n)] for n in (40, 33)]
    hf_model = transformers_model(path)
    expected = [hf_greedy(hf_model, p, MAX_NEW, top_n=1)[0] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    with LLM(str(path), **ENGINE) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.num_preempted_total > 0  # they did not all fit at once


def test_only_models_windowed_in_every_layer_free_blocks(checkpoint):
    """Gemma 2 (alternating global and windowed layers): one block table serves every layer, so
    nothing is freed (README: per-layer-group tables are not done); Phi-3 windows every layer;
    Qwen2 with `use_sliding_window` every layer from `max_window_layers` on."""
    assert EngineConfig(model=str(checkpoint("gemma2")), **ENGINE).resolve().kv_sliding_window == 0
    assert EngineConfig(model=str(checkpoint("phi3")), **ENGINE).resolve().kv_sliding_window == 32
    # Qwen2's window starts at layer max_window_layers (transformers): all-windowed only from 0.
    for first, expected in ((1, 0), (0, 16)):
        hf = hf_config_dict("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=first)
        assert uniform_sliding_window(ModelConfig.from_hf_config(hf)) == expected
