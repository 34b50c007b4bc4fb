"""The draft_model proposer's token_map (speculative/config.py, speculative/draft_model.py `hot_head`).

The idea of SGLang's --speculative-token-map (FR-Spec, "lower lm_head
overhead" for its EAGLE drafts: docs/advanced_features/speculative_decoding.md)
for Trillium's draft_model: the draft's LM head cut to the frequent tokens, the
ids read from JSON, never pickle (SGLang's .pt files are not read, so this is
not a compatibility claim). Checked here: the file's checks at start-up (and an id past the draft's
vocabulary at resolve); the cut head's logits are the full head's at the map's
rows, for float heads (own and tied) and a packed Q8_0 one; drafts are the
argmax over the map (a permutation of the whole vocabulary drafts exactly
what no map does); a draft weight update rebuilds the cut head; greedy output
through `LLM` is token for token the non-speculative one.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from trillium import LLM, SamplingParams
from trillium.config import EngineConfig
from trillium.speculative.config import parse_speculative_config

K = 3
VOCAB = 512


def _map(tmp_path, ids, name="map.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(ids))
    return str(path)


def _spec(draft: str, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": K, **extra}


def test_the_file_is_checked_at_start_up(tmp_path, first_layer_draft):
    spec = parse_speculative_config(_spec("/d", token_map=_map(tmp_path, [5, 3, 9])))
    assert spec.token_map_ids == (5, 3, 9) and spec.token_map.endswith("map.json")
    (tmp_path / "bad.json").write_text("[1, 2")
    refused = [
        (_map(tmp_path, [], "empty.json"), "non-empty JSON list"),
        (_map(tmp_path, {"ids": [1]}, "dict.json"), "non-empty JSON list"),
        (_map(tmp_path, [1, 2, 1], "dup.json"), "more than once"),
        (_map(tmp_path, [1, -2], "neg.json"), "-2 is not a token id"),
        (_map(tmp_path, [1, True], "bool.json"), "True is not a token id"),
        (_map(tmp_path, [1, 2.5], "float.json"), "2.5 is not a token id"),
        (str(tmp_path / "bad.json"), "is not JSON"),
        (str(tmp_path / "missing.json"), "No such file"),
        (7, "must be a file path"),
    ]
    for value, needle in refused:
        with pytest.raises(ValueError, match=needle):
            parse_speculative_config(_spec("/d", token_map=value))
    with pytest.raises(ValueError, match="token_map not supported with method 'ngram'"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "token_map": "x.json"})
    target, draft = first_layer_draft
    past = EngineConfig.build(model=target, num_blocks=20,
                              speculative_config=_spec(draft, token_map=_map(tmp_path, [1, VOCAB], "past.json")))
    with pytest.raises(ValueError, match=f"token id {VOCAB}, past the draft's vocabulary of {VOCAB}"):
        past.resolve()


def _cut_matches_full(model, ids: torch.Tensor) -> None:
    from trillium.speculative.draft_model import hot_head

    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    full = model.compute_logits(hidden)
    cut = hot_head(model, ids)(hidden)
    assert cut.shape == (5, len(ids)) and cut.dtype == torch.float32
    torch.testing.assert_close(cut, full[:, ids], rtol=1e-5, atol=1e-5)


def test_the_cut_head_is_the_full_head_at_the_maps_rows():
    from trillium.models.llama import Linear, linear
    from trillium.models.packed_linear import GgufLinear

    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([7, 300, 2, 511, 64], dtype=torch.int64)
    weight = torch.randn(VOCAB, 64, generator=gen)

    def model(head, head_weight):
        def compute_logits(hidden):
            return (head(hidden) if head is not None else linear(hidden, head_weight)).float()
        return types.SimpleNamespace(lm_head=head, lm_head_weight=head_weight, compute_logits=compute_logits)

    own = Linear(64, VOCAB, bias=False)
    own.weight.data.copy_(weight)
    _cut_matches_full(model(own, own.weight), ids)
    _cut_matches_full(model(None, weight), ids)  # a tied head: the embedding's rows
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from trillium.kernels import gguf_cpu

    blocks = torch.from_numpy(np.ascontiguousarray(quantize(weight.numpy(), GGMLQuantizationType.Q8_0)))
    for activations in (gguf_cpu.FLOAT32, gguf_cpu.INT8):
        packed = GgufLinear(blocks, int(GGMLQuantizationType.Q8_0), 64, None, activations)
        _cut_matches_full(model(packed, None), ids)
    from trillium.speculative.draft_model import hot_head

    with pytest.raises(ValueError, match="cannot be cut"):
        hot_head(types.SimpleNamespace(lm_head=torch.nn.Identity()), ids)


class _Req:
    def __init__(self, request_id: str, token_ids: list[int]) -> None:
        self.request_id, self.token_ids = request_id, token_ids


def _proposer(target: str, draft: str, **extra):
    from trillium.speculative.draft_model import DraftModelProposer

    config = EngineConfig.build(model=target, num_blocks=8, max_num_seqs=2, max_model_len=64,
                                speculative_config=_spec(draft, **extra)).resolve()
    return DraftModelProposer(config, torch.device("cpu"))


def test_drafts_are_the_argmax_over_the_map_and_follow_weight_updates(tmp_path, first_layer_draft):
    from trillium.actors.executor import weights
    from trillium.speculative.draft_weights import flush_draft_state

    target, draft = first_layer_draft
    prompt = list(range(40, 60))
    whole = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)).tolist()
    plain = _proposer(target, draft)
    permuted = _proposer(target, draft, token_map=_map(tmp_path, whole))
    expected = plain.propose_batch([_Req("a", list(prompt))], [K])[0]
    assert permuted.propose_batch([_Req("a", list(prompt))], [K])[0] == expected
    # Half the vocabulary, without the tokens the full head drafts: every draft comes from the map.
    half = [t for t in whole if t not in expected][: VOCAB // 2]
    cut = _proposer(target, draft, token_map=_map(tmp_path, half, "half.json"))
    drafts = cut.propose_batch([_Req("b", list(prompt))], [K])[0]
    assert len(drafts) == K and set(drafts) <= set(half)
    # The first draft is the argmax of the full head's logits restricted to the map.
    plain.release(["a"])
    hidden = {}
    forward = plain.forward
    plain.forward = lambda *a, **k: hidden.setdefault("h", forward(*a, **k))
    plain.propose_batch([_Req("c", list(prompt))], [1])
    with torch.inference_mode():
        logits = plain.model.compute_logits(hidden["h"][-1:])[0]
    assert drafts[0] == half[int(logits[torch.tensor(half)].argmax())]
    # A draft weight update (new LM head rows), then the flush every update ends with
    # (executor/control.py): the cut head is rebuilt from the new weights.
    new_head = torch.randn(VOCAB, 64, generator=torch.Generator().manual_seed(4))
    reference = _proposer(target, draft)
    for proposer in (permuted, reference):
        weights.apply(proposer.model, [("lm_head.weight", new_head.clone())])
        core = types.SimpleNamespace(config=types.SimpleNamespace(speculative_config=types.SimpleNamespace(
            method="draft_model")), requests={}, proposer=proposer)
        flush_draft_state(core)
    after = reference.propose_batch([_Req("d", list(prompt))], [K])[0]
    assert after != expected, "the new head should draft other tokens"
    assert permuted.propose_batch([_Req("d", list(prompt))], [K])[0] == after


def test_greedy_identity_with_a_token_map(tmp_path, first_layer_draft):
    target, draft = first_layer_draft
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[: VOCAB // 2].tolist()
    prompts = [{"prompt_token_ids": [11, 12, 13, 14, 15] * 4}, {"prompt_token_ids": list(range(20, 60))}]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 17)]
    engine = dict(num_blocks=20, max_num_batched_tokens=96, max_num_seqs=4)
    with LLM(target, **engine) as base, LLM(target, speculative_config=_spec(draft, token_map=_map(tmp_path, ids)),
                                            **engine) as spec:
        ref = base.generate(prompts, params)
        out = spec.generate(prompts, params)
        stats = spec.get_stats()
    assert [c.token_ids for x in ref for c in x.outputs] == [c.token_ids for x in out for c in x.outputs]
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
