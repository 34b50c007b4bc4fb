"""LLM.embed / classify / reward / score on pooling checkpoints, against transformers.

The oracle is transformers on the same float32 checkpoint:
AutoModelForSequenceClassification's logits (the `score` head on the last
non-pad token; our prompts hold no pad) and AutoModel's last hidden state
(LAST: its last row, MEAN: the mean of its rows). Post-processing mirrors
vLLM: vllm/model_executor/layers/pooler/seqwise/heads.py (cut to
`dimensions`, then L2-normalize) and activations.py (softmax, or sigmoid for
one label). Within 1e-4 in float32.

The engines run with a 32-token step budget, so the long prompts are
prefilled in chunks, and each prompt runs twice, so the second run reads its
prefix from the cache (LAST pooling) -- the same scheduler as generation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.waiting import wait_until
from trillium import LLM

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "a short one",
    "once upon a time there was a little robot who wanted to learn how to paint the sea and the sky "
    "and the tall green trees by the river",
]
TOL = 1e-4


def _hf_classifier(path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()


def _hf_backbone(path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    return hf(torch.tensor([ids])).logits[0].numpy()


@torch.inference_mode()
def _hf_hidden(hf, ids: list[int]) -> np.ndarray:
    return hf(torch.tensor([ids])).last_hidden_state[0].numpy()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def classify_llm(checkpoint):
    path = checkpoint("llama-classify")
    with LLM(str(path), max_num_batched_tokens=32, block_size=16, kv_cache_memory="16MiB") as llm:
        yield llm, path


@pytest.fixture(scope="module")
def reward_llm(checkpoint):
    path = checkpoint("qwen3-reward")
    with LLM(str(path), convert="reward", max_num_batched_tokens=32, block_size=16, kv_cache_memory="16MiB") as llm:
        yield llm, path


@pytest.fixture(scope="module")
def embed_llm(checkpoint):
    path = checkpoint("qwen3-embed")
    with LLM(str(path), max_num_batched_tokens=32, block_size=16, kv_cache_memory="16MiB") as llm:
        yield llm, path


def test_classifier_probs_match_transformers_chunked_and_prefix_cached(classify_llm):
    llm, path = classify_llm
    hf = _hf_classifier(path)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert max(len(i) for i in ids) > 32  # chunked prefill
    first = llm.classify(PROMPTS)
    second = llm.classify(PROMPTS)  # prefix-cache hits this time
    # WHY wait: stats travel beside the outputs, not before them.
    wait_until(lambda: llm.get_stats().prefix_cache_hits_total > 0, timeout_s=10, interval_s=0.01,
               what="prefix-cache hits in the stats")
    for out_1, out_2, prompt_ids in zip(first, second, ids):
        expected = _softmax(_hf_logits(hf, prompt_ids))
        assert out_1.prompt_token_ids == prompt_ids
        np.testing.assert_allclose(out_1.outputs.probs, expected, atol=TOL)
        np.testing.assert_allclose(out_2.outputs.probs, expected, atol=TOL)
    raw = llm.reward(PROMPTS[:1])[0].outputs.data  # the raw logits
    np.testing.assert_allclose(raw, _hf_logits(hf, ids[0]), atol=TOL)


def test_pooling_model_refuses_generate_and_other_tasks(classify_llm):
    llm, _ = classify_llm
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="'classify', not 'embed'"):
        llm.embed("hello")
    with pytest.raises(ValueError, match="cross-encoder has one label"):
        llm.score("a", "b")


def test_reward_model_raw_scores_and_cross_encoder(reward_llm):
    llm, path = reward_llm
    hf = _hf_classifier(path)
    outputs = llm.classify(PROMPTS)  # --convert reward: raw by default
    for out, prompt in zip(outputs, PROMPTS):
        expected = _hf_logits(hf, llm.tokenizer.encode(prompt))
        np.testing.assert_allclose(out.outputs.probs, expected, atol=TOL)
    query, docs = "the fox", ["the quick brown fox", "a little robot"]
    scores = llm.score(query, docs, use_activation=True)
    for out, doc in zip(scores, docs):
        pair = llm.tokenizer.hf(query, text_pair=doc)["input_ids"]
        logit = _hf_logits(hf, pair)[0]
        assert out.outputs.score == pytest.approx(1 / (1 + np.exp(-logit)), abs=TOL)


def test_embeddings_match_transformers_last_token(embed_llm):
    llm, path = embed_llm
    hf = _hf_backbone(path)
    outputs = llm.embed(PROMPTS)
    again = llm.embed(PROMPTS)
    for out, out_2, prompt in zip(outputs, again, PROMPTS):
        last = _hf_hidden(hf, llm.tokenizer.encode(prompt))[-1]
        np.testing.assert_allclose(out.outputs.embedding, last / np.linalg.norm(last), atol=TOL)
        np.testing.assert_allclose(out_2.outputs.embedding, out.outputs.embedding, atol=TOL)
        raw = llm.embed(prompt, normalize=False)[0].outputs.embedding
        np.testing.assert_allclose(raw, last, atol=TOL * max(1.0, float(np.abs(last).max())))
        cut = llm.embed(prompt, dimensions=16)[0].outputs.embedding  # Matryoshka: cut, then normalize
        np.testing.assert_allclose(cut, last[:16] / np.linalg.norm(last[:16]), atol=TOL)


def test_embedding_model_scores_cosine_and_checks_dimensions(embed_llm):
    llm, path = embed_llm
    hf = _hf_backbone(path)
    (score,) = llm.score(PROMPTS[0], PROMPTS[1])
    a, b = (_hf_hidden(hf, llm.tokenizer.encode(p))[-1] for p in PROMPTS[:2])
    assert score.outputs.score == pytest.approx(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), abs=TOL)
    with pytest.raises(ValueError, match=r"only supports \[16, 32, 64\]"):
        llm.embed("x", dimensions=20)


def test_mean_pooling_over_chunks_matches_transformers(checkpoint):
    path = checkpoint("qwen3-embed")
    hf = _hf_backbone(path)
    with LLM(str(path), pooler_config='{"pooling_type": "MEAN"}', max_num_batched_tokens=32, kv_cache_memory="16MiB",
             block_size=16) as llm:
        assert not llm.config.enable_prefix_caching  # MEAN pools every row: no cached rows
        outputs = llm.embed(PROMPTS)
        for out, prompt in zip(outputs, PROMPTS):
            mean = _hf_hidden(hf, llm.tokenizer.encode(prompt)).mean(axis=0)
            np.testing.assert_allclose(out.outputs.embedding, mean / np.linalg.norm(mean), atol=TOL)


def test_encode_token_embed_rows_never_read_the_prefix_cache(embed_llm):
    """vllm/entrypoints/pooling/llm.py LLM.encode(pooling_task=...): token_embed gives every prompt
    token's hidden state, each normalized (tokwise/heads.py TokenEmbeddingPoolerHead), also right
    after `embed` cached the prompts' blocks (vllm/pooling_params.py: token tasks skip reading the
    prefix cache) and across 32-token chunks."""
    llm, path = embed_llm
    hf = _hf_backbone(path)
    llm.embed(PROMPTS)  # LAST: caches the prompts' full blocks
    outputs = llm.encode(PROMPTS, pooling_task="token_embed")
    for out, prompt in zip(outputs, PROMPTS):
        hidden = _hf_hidden(hf, llm.tokenizer.encode(prompt))
        rows = np.array(out.outputs.data)
        assert rows.shape == hidden.shape
        np.testing.assert_allclose(rows, hidden / np.linalg.norm(hidden, axis=-1, keepdims=True), atol=TOL)
    cut = np.array(llm.encode(PROMPTS[2], pooling_task="token_embed", dimensions=16)[0].outputs.data)
    np.testing.assert_allclose(cut, hidden[:, :16] / np.linalg.norm(hidden[:, :16], axis=-1, keepdims=True),
                               atol=TOL)
    (seq,) = llm.encode(PROMPTS[2], pooling_task="embed")
    np.testing.assert_allclose(seq.outputs.data, hidden[-1] / np.linalg.norm(hidden[-1]), atol=TOL)
    with pytest.raises(ValueError, match="Unsupported task: 'token_classify'"):
        llm.encode("x", pooling_task="token_classify")
    with pytest.raises(ValueError, match="pooling_task is required"):
        llm.encode("x")


def test_encode_token_classify_matches_the_score_head_per_token(classify_llm):
    """DispatchPooler.for_seq_cls (vllm/model_executor/layers/pooler/special.py): token_classify is
    the score head on every prompt row (AllPool), softmax per row unless use_activation is false."""
    llm, path = classify_llm
    hf = _hf_classifier(path)
    ids = llm.tokenizer.encode(PROMPTS[2])
    with torch.inference_mode():
        logits = hf.score(hf.model(torch.tensor([ids])).last_hidden_state)[0].numpy()
    (out,) = llm.encode(PROMPTS[2], pooling_task="token_classify")
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(out.outputs.data, e / e.sum(axis=-1, keepdims=True), atol=TOL)
    (raw,) = llm.encode(PROMPTS[2], pooling_task="token_classify", use_activation=False)
    np.testing.assert_allclose(raw.outputs.data, logits, atol=TOL)
    with pytest.raises(ValueError, match="Unsupported task: 'token_embed'"):
        llm.encode("x", pooling_task="token_embed")


def _reset_prefix_cache(llm) -> None:
    import time

    from trillium.actors.protocol.admin import ResetPrefixCache

    assert llm._call(llm._client.control, ResetPrefixCache(f"t{time.monotonic_ns()}")).status == 200


def test_embeddings_sent_together_with_a_shared_prefix_match_each_alone(embed_llm):
    """Same-step prefix sharing (scheduler/step_plan.py; vLLM v1 caches a block as its slots are
    allocated: vllm/v1/core/kv_cache_manager.py `allocate_slots`): the second prompt, admitted in
    the same 32-token step as the first, reads the first's 16-token block as it is computed (or, if
    the api's adds reach the scheduler a step apart, once computed), and its embedding equals the
    one computed apart. The scheduler test (test_same_step_prefix.py) pins the same-step part."""
    llm, _ = embed_llm
    prefix = list(range(5, 23))  # one full 16-token block, and two tokens more
    prompts = [{"prompt_token_ids": prefix + [30, 31, 32]}, {"prompt_token_ids": prefix + [40, 41]}]
    apart = []
    for prompt in prompts:
        _reset_prefix_cache(llm)
        apart.append(llm.embed([prompt])[0].outputs.embedding)
    _reset_prefix_cache(llm)
    hits = llm.get_stats().prefix_cache_hits_total
    together = llm.embed(prompts)
    wait_until(lambda: llm.get_stats().prefix_cache_hits_total > hits, timeout_s=5, interval_s=0.02,
               what="the step's stats")
    assert llm.get_stats().prefix_cache_hits_total - hits == 16
    for out, alone in zip(together, apart):
        np.testing.assert_allclose(out.outputs.embedding, alone, atol=1e-5)
