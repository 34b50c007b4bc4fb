"""Gemma 2 / Gemma 3 GGUF files, written as llama.cpp writes them, load to the HF checkpoint's model.

What llama.cpp does (ggml-org/llama.cpp convert_hf_to_gguf.py / conversion/gemma.py
`Gemma2Model`, `Gemma3Model`; src/llama-model.cpp hparams for LLM_ARCH_GEMMA2/3): norm weights
stored + 1; Gemma 2 without `lm_head` (always tied) and without a rope base;
`attn_logit_softcapping` / `final_logit_softcapping` / `attention.sliding_window`
as metadata; Gemma 3 with the full layers' rope base and linear scaling only.
query_pre_attn_scalar, the sliding-layer pattern (2 / 6) and Gemma 3's local
rope base (10000) are not stored: llama.cpp fixes them per architecture, so the
checkpoints here use values llama.cpp can express (scalar = head_dim, Gemma 3
with 5 sliding layers then a full one).

transformers' own GGUF loader (huggingface/transformers
src/transformers/integrations/ggml.py GGUF_CONFIG_MAPPING["gemma2"/"gemma3"],
src/transformers/modeling_gguf_pytorch_utils.py `Gemma2TensorProcessor`, norm - 1)
reads the same files; it keeps Gemma2Config's query_pre_attn_scalar default
(256, hence head_dim 256 here) and reads no `rope.scaling.*` for gemma3, so it
is compared on an unscaled Gemma 3 file.
"""

from __future__ import annotations

import pytest
import torch

from trillium.models.gguf_writer import write_gguf
from support.paged_runner import hf_logits, load_hf, max_abs_diff, random_sequences, run_schedule
from trillium import LLM, SamplingParams
from trillium.models import ModelConfig, load_model
from trillium.models.config_families import FULL, SLIDING

_GEMMA3_LAYOUT = {"num_hidden_layers": 6, "layer_types": [SLIDING] * 5 + [FULL]}
CASES = {
    # llama.cpp drops Gemma 2's lm_head, so the checkpoint is tied.
    "gemma2": ("gemma2", {"tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256}),
    "gemma3": ("gemma3", {**_GEMMA3_LAYOUT, "head_dim": 256, "query_pre_attn_scalar": 256}),
    "gemma3-unscaled": ("gemma3", {**_GEMMA3_LAYOUT, "head_dim": 256, "query_pre_attn_scalar": 256,
                                   "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                                       FULL: {"rope_type": "default", "rope_theta": 1e6}}}),
}  # fmt: skip
LENGTHS = (9, 41, 6)
# Sequence 1 prefills 30 tokens (past the 16-token window), then a chunk and decodes.
SCHEDULE = (((0, 6), (1, 30), (2, 3)), ((0, 1), (1, 7), (2, 1)), ((0, 1), (1, 1), (2, 1)),
            ((0, 1), (1, 1), (2, 1)), ((1, 1),), ((1, 1),))  # fmt: skip
_FIELDS = ("architecture", "num_heads", "num_kv_heads", "head_dim", "qk_norm", "sliding_window", "layer_types",
           "gemma", "tie_word_embeddings", "rope_theta", "rope_scaling")  # fmt: skip


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """case -> (HF dir, the .gguf written from it), built once per module."""
    from trillium.models.synthetic import build_checkpoint

    built = {}

    def get(case: str):
        if case not in built:
            variant, overrides = CASES[case]
            root = tmp_path_factory.mktemp(f"gguf-{case}")
            hf_dir = build_checkpoint(root / "hf", variant, **overrides)
            built[case] = hf_dir, write_gguf(hf_dir, root / f"{case}.gguf")
        return built[case]

    return get


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "gemma3-unscaled"])
def test_gemma_gguf_logits_match_hf_dir_and_transformers_gguf(gguf_files, case):
    hf_dir, gguf_path = gguf_files(case)
    model, config = load_model(gguf_path, progress=False)
    hf_config = ModelConfig.from_hf_dir(hf_dir)
    for field in _FIELDS:
        assert getattr(config, field) == getattr(hf_config, field), field
    sequences = random_sequences(config.vocab_size, lengths=LENGTHS, seed=1)
    ours = run_schedule(model, sequences, schedule=SCHEDULE, num_blocks=64)
    assert max_abs_diff(ours, hf_logits(load_hf(hf_dir), sequences)) < 1e-4
    if case != "gemma3":  # transformers' GGUF gemma3 config has no rope scaling
        from transformers import AutoModelForCausalLM

        theirs = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                      dtype=torch.float32).eval()  # fmt: skip
        assert max_abs_diff(ours, hf_logits(theirs, sequences)) < 1e-4


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_gemma_gguf_greedy_tokens_match_hf_dir(gguf_files, case):
    hf_dir, gguf_path = gguf_files(case)
    prompts = [{"prompt_token_ids": list(range(20 + i, 60 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    # NOTE: the test writer stores no vocabulary, so the GGUF run takes the HF dir's tokenizer (vLLM's --tokenizer).
    for path in (hf_dir, gguf_path):
        with LLM(str(path), tokenizer=str(hf_dir), kv_cache_memory="16MiB", num_threads=1,
                 max_num_batched_tokens=32) as llm:  # fmt: skip
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert tokens[0] == tokens[1]
    assert all(len(t) == 12 for t in tokens[0])


def test_gguf_gemma_layout_follows_llama_cpp():
    """llama.cpp's layer patterns (gemma3 5:1, gemma2 1:1); its 27B sizes (by block count) scale by hidden/heads."""
    from trillium.models.config_families import gguf_gemma

    get = {"attention.sliding_window": 1024}.get
    spec, types = gguf_gemma(get, "Gemma3ForCausalLM", 62, 168, 128)
    assert types[:6] == (SLIDING,) * 5 + (FULL,) and spec.query_pre_attn_scalar == 168
    assert spec.local_rope_theta == 10000.0 and spec.attn_logit_softcapping is None
    spec, types = gguf_gemma(get, "Gemma2ForCausalLM", 26, 144, 256)
    assert types[:2] == (SLIDING, FULL) and spec.query_pre_attn_scalar == 256
    spec, types = gguf_gemma({}.get, "Gemma2ForCausalLM", 26, 144, 256)
    assert types is None
    # Keys llama.cpp ignores for these architectures are refused when they disagree, accepted when they agree.
    agree = {"attention.sliding_window": 16, "attention.sliding_window_pattern": [True] * 5 + [False],
             "rope.freq_base_swa": 10000.0}.get  # fmt: skip
    assert gguf_gemma(agree, "Gemma3ForCausalLM", 6, 16, 16)[1] == (SLIDING,) * 5 + (FULL,)
    with pytest.raises(ValueError, match="sliding_window_pattern"):
        gguf_gemma({"attention.sliding_window": 16, "attention.sliding_window_pattern": 3}.get,
                   "Gemma3ForCausalLM", 6, 16, 16)  # fmt: skip
    with pytest.raises(ValueError, match="freq_base_swa"):
        gguf_gemma({"attention.sliding_window": 16, "rope.freq_base_swa": 5e5}.get, "Gemma3ForCausalLM", 6, 16, 16)


def test_multimodal_projector_gguf_is_refused():
    with pytest.raises(ValueError, match="mmproj"):
        ModelConfig.from_gguf_metadata({"general.architecture": "clip"}, set())
    with pytest.raises(ValueError, match="gemma3n.*supported"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gemma3n"}, set())
