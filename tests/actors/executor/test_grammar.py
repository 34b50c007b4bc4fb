"""Executor side of structured outputs (executor/grammar.py): compiles off the
step's path, per-sequence matchers, the sampler's bitmask stage.

xgrammar's own GrammarMatcher and bitmask are the reference; the tokenizer is
a synthetic checkpoint's byte-level BPE (a real 512-token vocabulary), under a
model vocabulary larger than the tokenizer's (the extra ids must never pass).
"""

from __future__ import annotations

import time

import pytest
import torch
import xgrammar as xgr

from trillium.actors.executor import grammar as grammar_module
from trillium.actors.executor.grammar import GrammarCompiler, GrammarConstraint, apply_grammar_bitmask
from trillium.actors.executor.sampler import SamplingState, sample
from trillium.models.tokenizer import load_tokenizer
from trillium.sampling_params import SamplingParams
from trillium.structured_outputs import StructuredOutputsParams, build_grammar

MODEL_VOCAB = 544  # > the tokenizer's 512: padded embedding rows, as real checkpoints have
REGEX = StructuredOutputsParams(regex=r"(ab|c)+!")


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def compiler(path):
    compiler = GrammarCompiler(str(path), MODEL_VOCAB)
    yield compiler
    compiler.close()


def _ready(compiler: GrammarCompiler, keys) -> dict:
    compiler.submit(keys)
    merged: dict = {"grammars_ready": (), "grammars_failed": {}, "grammars_evicted": ()}
    deadline = time.monotonic() + 60
    while compiler.num_pending and time.monotonic() < deadline:
        got = compiler.completions(timeout_s=0.5)
        for name in ("grammars_ready", "grammars_evicted"):
            merged[name] += got.get(name, ())
        merged["grammars_failed"].update(got.get("grammars_failed", {}))
    return merged


def _reference(path, params):
    tokenizer = load_tokenizer(path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=MODEL_VOCAB,
                                              stop_token_ids=list(tokenizer.eos_token_ids))
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(build_grammar(params)))


def test_compiles_report_once_and_nothing_when_idle(compiler):
    got = _ready(compiler, [REGEX.key])
    assert got["grammars_ready"] == (REGEX.key,) and not got["grammars_failed"]
    assert compiler.completions() == {}  # the common step pays nothing
    _ready(compiler, [REGEX.key])  # already compiled: no new compile, no report
    assert compiler.num_pending == 0


def test_bitmask_matches_xgrammar_and_leaves_other_rows_alone(path, compiler):
    _ready(compiler, [REGEX.key])
    eos = list(load_tokenizer(path).eos_token_ids)
    constraint = compiler.constraint(REGEX, eos)
    reference = _reference(path, REGEX)
    torch.manual_seed(0)
    logits = torch.randn(3, MODEL_VOCAB)
    before = logits.clone()
    outputs: list[int] = []
    for _ in range(6):
        logits = torch.randn(3, MODEL_VOCAB)
        before = logits.clone()
        apply_grammar_bitmask(logits, [None, constraint, None], [[], outputs, []])
        mask = xgr.allocate_token_bitmask(1, MODEL_VOCAB)
        reference.fill_next_token_bitmask(mask)
        expected = before[1:2].clone()
        xgr.apply_token_bitmask_inplace(expected, mask)
        assert torch.equal(logits[1], expected[0])
        assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
        assert torch.isinf(logits[1, 512:]).all()  # ids past the tokenizer's vocabulary never pass
        token = int(logits[1].argmax())
        assert reference.accept_token(token)
        outputs.append(token)
        if reference.is_terminated():
            break


def test_after_the_grammar_ends_only_stop_tokens_pass(path, compiler):
    """ignore_eos: the request goes on past the stop token; only stop tokens may follow."""
    choice = StructuredOutputsParams(choice=("c!",))
    _ready(compiler, [choice.key])
    tokenizer = load_tokenizer(path)
    eos = list(tokenizer.eos_token_ids)
    constraint = compiler.constraint(choice, eos)
    outputs = [*tokenizer.encode("c!", add_special_tokens=False), eos[0]]
    for _ in range(2):
        logits = torch.randn(1, MODEL_VOCAB)
        apply_grammar_bitmask(logits, [constraint], [outputs])
        assert sorted(torch.nonzero(~torch.isinf(logits[0])).flatten().tolist()) == sorted(eos)
        outputs.append(eos[-1])


def test_activate_after_waits_for_the_trigger(path, compiler):
    _ready(compiler, [REGEX.key])
    constraint = GrammarConstraint(compiler.compiled(REGEX.key), [2], activate_after=(40, 41))
    logits = torch.randn(1, MODEL_VOCAB)
    before = logits.clone()
    apply_grammar_bitmask(logits, [constraint], [[40, 7, 40]])
    assert torch.equal(logits, before) and not constraint.active
    apply_grammar_bitmask(logits, [constraint], [[40, 7, 40, 41]])
    assert constraint.active and torch.isinf(logits).sum() > MODEL_VOCAB - 20  # only a/c tokens left


def test_sampling_follows_the_grammar_and_logprobs_exclude_banned_tokens(path, compiler):
    _ready(compiler, [REGEX.key])
    eos = list(load_tokenizer(path).eos_token_ids)
    params = SamplingParams(temperature=1.0, seed=5, logprobs=3, structured_outputs=REGEX)
    state = SamplingState(params, [5, 6], vocab_size=MODEL_VOCAB, eos_token_ids=eos,
                          grammar=compiler.constraint(REGEX, eos))
    reference = _reference(path, REGEX)
    for _ in range(12):
        out = sample(torch.randn(1, MODEL_VOCAB) * 5, [state])
        token = int(out.token_ids[0])
        assert reference.accept_token(token), token
        top = out.logprobs.row(0)
        assert all(lp > float("-inf") for lp in top.top_logprobs[:1])
        state.append(token)
        if reference.is_terminated():
            break
    assert reference.is_terminated() and state.output_token_ids[-1] in eos


def test_lru_eviction_is_reported(path, monkeypatch):
    monkeypatch.setattr(grammar_module, "MAX_CACHED_GRAMMARS", 2)
    compiler = GrammarCompiler(str(path), MODEL_VOCAB)
    try:
        keys = [StructuredOutputsParams(choice=(w,)).key for w in ("x", "y", "z")]
        # WHY one at a time: two at once may finish in either order on the 2-thread pool,
        # and the least recently compiled is the one evicted.
        _ready(compiler, keys[:1])
        _ready(compiler, keys[1:2])
        got = _ready(compiler, keys[2:])
        assert got["grammars_evicted"] == (keys[0],)
        assert compiler.compiled(keys[0]) is not None  # compiled again, on the step's path (logged)
    finally:
        compiler.close()


def test_no_tokenizer_fails_the_compile_with_the_reason(tmp_path):
    compiler = GrammarCompiler(str(tmp_path), MODEL_VOCAB)
    try:
        got = _ready(compiler, [REGEX.key])
        assert got["grammars_ready"] == () and REGEX.key in got["grammars_failed"]
    finally:
        compiler.close()
