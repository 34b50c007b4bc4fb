"""The eagle proposer: vLLM's EAGLE-1 checkpoint format, the head's cache, exactness, real acceptance.

Mirrors vLLM's reading of an EAGLE head (vllm-project/vllm
vllm/model_executor/models/llama_eagle.py: fc over cat(embed, hidden), layer 0
without input_layernorm, no final norm, "model." prefixed names, embed_tokens
shared with the target) and its drafting loop (vllm/v1/spec_decode/eagle.py
EagleProposer.propose: ids shifted by one, greedy argmax, one step per draft).
The head is trained here on the target's own greedy outputs (teacher forced,
eagle_training.py), so acceptance is real: a trained head's drafts are
accepted far more than an untrained one's, and greedy output is the target's
token for token (vLLM's tests/v1/e2e/test_spec_decode.py check, with eagle).
"""

from __future__ import annotations

import json
import random

import attrs
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trillium import LLM, SamplingParams
from trillium.config import EngineConfig
from trillium.models.loader import load_model
from trillium.speculative.config import parse_speculative_config
from trillium.speculative.eagle import EagleHead, EagleProposer, load_head
from trillium.speculative.eagle_checkpoint import head_config_dict, write_checkpoint
from trillium.speculative.eagle_training import target_hidden_states, train_head

K = 4
# 16 blocks of 16 tokens: the engine test's batch needs ~30, so requests are preempted.
ENGINE = dict(num_blocks=16, max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def base(checkpoint):
    with LLM(str(checkpoint("llama")), **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def target(checkpoint, base):
    """(path, model, prompts, sequences): the prompts followed by the target's greedy outputs."""
    path = checkpoint("llama")
    model, _ = load_model(path, dtype="float32", progress=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(8)] for _ in range(4)]
    outs = base.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    return path, model, prompts, [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """(trained, untrained) checkpoint directories for the target, in vLLM's format."""
    path, model, _, sequences = target
    out = []
    for name, steps in (("trained", 100), ("untrained", 0)):
        head = train_head(model, sequences, steps=steps, lr=1e-2)
        out.append(write_checkpoint(tmp_path_factory.mktemp(name), head_config_dict(model.config), head.hf_weights()))
    return out


@attrs.define
class _State:  # what propose_from_hidden reads of the executor's RequestState
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    eagle_kv: object = None


def _proposer(model, head_dir) -> EagleProposer:
    return EagleProposer(load_head(head_dir, model.config, max_positions=128, dtype=torch.float32, device="cpu"),
                         model, block_size=16)


def test_checkpoint_in_vllms_names_round_trips(target, tmp_path):
    _, model, _, _ = target
    config = attrs.evolve(model.config, num_layers=2)
    torch.manual_seed(1)
    head = EagleHead(config, fc_bias=True, max_positions=64)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.05)
    # As a converted EAGLE checkpoint carries them: "model." names, the embedding and a head (both ignored).
    tensors = {f"model.{name}": t.clone() for name, t in head.hf_weights().items()}
    tensors["model.embed_tokens.weight"] = torch.zeros(config.vocab_size, config.hidden_size)
    tensors["lm_head.weight"] = torch.zeros(config.vocab_size, config.hidden_size)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf = {**head_config_dict(model.config, num_layers=2), "architectures": ["EagleLlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    h = config.hidden_size
    assert tensors["model.fc.weight"].shape == (h, 2 * h)
    assert "model.layers.0.input_layernorm.weight" not in tensors and "model.layers.1.input_layernorm.weight" in tensors
    loaded = load_head(tmp_path, model.config, max_positions=64, dtype=torch.float32, device="cpu")
    x, hid = torch.randn(5, h), torch.randn(5, h)
    with torch.no_grad():
        ref = head(x, hid, torch.arange(5), [(None, 5)])
        assert torch.equal(loaded(x, hid, torch.arange(5), [(None, 5)]), ref)
    # write_checkpoint's own files read back the same.
    again = write_checkpoint(tmp_path / "again", hf, loaded.hf_weights())
    with safe_open(str(again / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(n.removeprefix("model.") for n in tensors if "embed" not in n
                                          and "lm_head" not in n)
    with torch.no_grad():
        reread = load_head(again, model.config, max_positions=64, dtype=torch.float32, device="cpu")
        assert torch.equal(reread(x, hid, torch.arange(5), [(None, 5)]), ref)


def test_bad_configs_are_refused_by_name(target, heads, tmp_path):
    path, model, _, _ = target
    good = str(heads[0])
    hf = json.loads((heads[0] / "config.json").read_text())

    def head_dir(name: str, **changes):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**hf, **changes}))
        return str(d)

    spec = {"method": "eagle", "num_speculative_tokens": 2}
    for bad, words in (({**spec, "model": head_dir("e3", architectures=["Eagle3LlamaForCausalLM"])}, "EAGLE-3"),
                       ({**spec, "model": head_dir("aux", eagle_aux_hidden_state_layer_ids=[1])}, "EAGLE-3"),
                       ({**spec, "model": head_dir("hass", add_para_norm=True)}, "add_para_norm"),
                       ({**spec, "model": head_dir("arch", architectures=["LlamaForCausalLM"])}, "not an EAGLE head"),
                       ({**spec, "model": str(tmp_path)}, "no config.json"),
                       (spec, "needs model"),
                       ({**spec, "model": good, "prompt_lookup_min": 2}, "prompt_lookup_min"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "model": good}, "model"),
                       ({"method": "eagle3", "num_speculative_tokens": 2, "model": good}, "eagle3")):
        with pytest.raises(ValueError, match=words):
            parse_speculative_config(bad)
    # A head of another width is refused when the target is known (start-up: EngineConfig.resolve).
    wide = head_dir("wide", hidden_size=2 * hf["hidden_size"])
    with pytest.raises(ValueError, match="hidden_size"):
        EngineConfig.build(model=str(path), speculative_config={**spec, "model": wide}).resolve()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(hf))
    (pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pickle"):
        load_head(pickled, model.config, max_positions=64, dtype=torch.float32, device="cpu")


def test_the_head_kv_is_budgeted_per_block(target, heads):
    path = str(target[0])
    args = dict(model=path, kv_cache_memory="1MiB")
    plain = EngineConfig.build(**args).resolve()
    eagle = EngineConfig.build(**args, speculative_config={"method": "eagle", "model": str(heads[0]),
                                                           "num_speculative_tokens": K}).resolve()
    # llama: 2 layers of KV per token; the head 1: a third of each block's budget.
    assert eagle.num_blocks == (1 << 20) // (plain.kv_block_bytes * 3 // 2)


def _replay(proposer: EagleProposer, model, sequence: list[int], prompt_len: int, *, check_fresh: bool = False,
            preempt_at: int = -1, idle_every: int = 0):
    """Drive propose_from_hidden as the executor does over `sequence` (the target's greedy tokens):
    a prefill, then steps verifying K drafts (accepted: those matching the sequence), the
    rejected rows scored too (noise here: the head must not read them). check_fresh: every
    step's drafts equal those of a fresh cache fed every known position at once.
    preempt_at: that step drops the cache, as a preemption does. idle_every: every such step
    proposes nothing (adaptive depth 0: the head defers its rows). Returns (accepted, drafted)."""
    hidden = target_hidden_states(model, sequence)  # position t's row: the same in any batch
    state = _State("r", sequence[: prompt_len + 1], 0)
    drafts = proposer.propose_from_hidden(hidden, [(state, 0, prompt_len, K)])["r"]
    accepted = drafted = step = start = 0
    while len(state.token_ids) + K + 1 < len(sequence):
        begin = len(state.token_ids) - 1
        n_ok = 0
        while n_ok < len(drafts) and drafts[n_ok] == sequence[begin + 1 + n_ok]:
            n_ok += 1
        accepted, drafted, step = accepted + n_ok, drafted + len(drafts), step + 1
        state.num_computed_tokens = begin
        state.token_ids = sequence[: begin + n_ok + 2]
        if step == preempt_at:
            state.eagle_kv = None
        rows = hidden[begin : begin + 1 + len(drafts)].clone()
        rows[n_ok + 1 :] = torch.randn_like(rows[n_ok + 1 :])
        depth = 0 if idle_every and step % idle_every == 0 else K
        drafts = proposer.propose_from_hidden(rows, [(state, 0, 1 + len(drafts), depth)]).get("r", [])
        kv = state.eagle_kv
        start = begin if step == preempt_at else start
        assert kv.start == start  # a gap starts afresh
        assert kv.known_end == len(state.token_ids) - 1 + (K - 1 if depth else 0)  # then K - 1 drafts
        if check_fresh and depth:
            fresh = _State("f", state.token_ids, 0)
            assert proposer.propose_from_hidden(hidden, [(fresh, 0, len(state.token_ids) - 1, K)])["f"] == drafts
    return accepted, drafted


def test_the_head_cache_rolls_back_to_what_a_fresh_head_computes(target, heads):
    _, model, prompts, sequences = target
    for head_dir in heads:  # the untrained head's drafts are rejected at once: short accepted runs
        proposer = _proposer(model, head_dir)
        _replay(proposer, model, sequences[1], len(prompts[1]), check_fresh=True)
        _replay(proposer, model, sequences[1], len(prompts[1]), check_fresh=True, idle_every=2)
        _replay(proposer, model, sequences[1], len(prompts[1]), preempt_at=3)


def test_a_trained_head_accepts_far_more_than_an_untrained_one(target, heads):
    _, model, prompts, sequences = target
    rates = []
    for head_dir in heads:
        proposer = _proposer(model, head_dir)
        accepted = drafted = 0
        for prompt, seq in zip(prompts, sequences):
            a, d = _replay(proposer, model, seq, len(prompt))
            accepted, drafted = accepted + a, drafted + d
        rates.append(accepted / drafted)
    assert rates[0] > 0.6 and rates[1] < 0.1, rates


def test_greedy_identity_and_acceptance_through_the_engine(base, target, heads):
    path, _, prompts, _ = target
    spec = {"method": "eagle", "model": str(heads[0]), "num_speculative_tokens": K}
    rng = random.Random(5)
    others = [[rng.randrange(10, 500) for _ in range(12)] for _ in range(4)]  # not trained on
    items = [{"prompt_token_ids": p} for p in prompts + others]
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)] * 4
    params += [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 9, 30)]
    params.append(SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True))
    ref = base.generate(items, params)
    with LLM(str(path), speculative_config=spec, **ENGINE) as fast:
        before = fast.get_stats()
        got = fast.generate(items, params)
        stats = fast.get_stats()
    for x, y in zip(ref, got, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids
            for px, py in zip(cx.logprobs or (), cy.logprobs or (), strict=True):
                assert all(abs(px[t].logprob - py[t].logprob) < 1e-4 for t in px)
    assert stats.num_preempted_total > (before.num_preempted_total if before else 0), "16 blocks should preempt"
    drafted = stats.spec_decode_num_draft_tokens_total - (before.spec_decode_num_draft_tokens_total if before else 0)
    accepted = stats.spec_decode_num_accepted_tokens_total - (before.spec_decode_num_accepted_tokens_total
                                                             if before else 0)
    # Half the prompts were trained on (near-certain acceptance), half not (some).
    assert drafted > 0 and accepted / drafted > 0.4, (accepted, drafted)


def test_greedy_identity_when_disable_by_batch_size_skips_proposals(base, target, heads):
    """No drafts while more than 2 run; the head's cache still takes those steps' rows
    (deferred), so the survivors' drafts after them are accepted and the output is unchanged."""
    path, _, prompts, _ = target
    spec = {"method": "eagle", "model": str(heads[0]), "num_speculative_tokens": K, "disable_by_batch_size": 2}
    items = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (32, 6, 32, 6)]
    ref = base.generate(items, params)
    with LLM(str(path), speculative_config=spec, **ENGINE) as fast:
        got = fast.generate(items, params)
        stats = fast.get_stats()
    assert [c.token_ids for x in ref for c in x.outputs] == [c.token_ids for x in got for c in x.outputs]
    assert stats.spec_decode_num_steps_disabled_by_batch_size_total >= 4
    assert stats.spec_decode_num_accepted_tokens_total > 0.4 * stats.spec_decode_num_draft_tokens_total > 0
