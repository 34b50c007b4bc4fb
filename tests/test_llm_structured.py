"""Structured outputs through the offline API: `SamplingParams(structured_outputs=...)`.

Over the real actors with a random-weight model (its garbage becomes valid
only through the constraint); xgrammar's GrammarMatcher is the reference.
A constrained request in a batch must not change the other requests' tokens;
n > 1 gives each sample its own matcher; preemption (recompute and swap)
keeps each matcher's place, so a preempted run equals an unpreempted one.
Mirrors vLLM's offline use (vllm/sampling_params.py `StructuredOutputsParams`,
examples/offline_inference/structured_outputs.py).
"""

from __future__ import annotations

import json
import random
import re

import pytest
import xgrammar as xgr

from trillium import LLM, SamplingParams
from trillium.config import EngineConfig
from trillium.models.tokenizer import load_tokenizer
from trillium.structured_outputs import StructuredOutputsParams, build_grammar

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 99}}, "required": ["ok", "n"]}
REGEX = r"[a-z]{2,5}@(x|yz)\.io"
KINDS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=("left", "right", "up")),
    "grammar": StructuredOutputsParams(grammar='root ::= ("a" | "b")+ "."'),
    "structural_tag": StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
        "type": "tag", "begin": "<x>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</x>"}}),
}


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def tokenizer(path):
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def reference(tokenizer):
    """(params, token ids) -> xgrammar's verdict: every token accepted, and the
    last one (EOS) ends the grammar."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, stop_token_ids=list(tokenizer.eos_token_ids))
    compiler = xgr.GrammarCompiler(info)

    def valid(params: StructuredOutputsParams, token_ids) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(build_grammar(params)))
        return all(matcher.accept_token(t) for t in token_ids) and matcher.is_terminated()

    return valid


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(7, 400) for _ in range(rng.randint(8, 30))]} for _ in range(n)]


def test_each_kind_offline_and_the_batch_around_it_unchanged(path, reference, tokenizer):
    free = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=24, ignore_eos=True) for i in range(3)]
    free.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    constrained = [SamplingParams(temperature=1.0, seed=50 + i, max_tokens=200, structured_outputs=p)
                   for i, p in enumerate(KINDS.values())]
    prompts = _prompts(len(free) + len(constrained), seed=0)
    with LLM(str(path)) as llm:
        alone = llm.generate(prompts[:len(free)], free)
        mixed = llm.generate(prompts, free + constrained)
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in mixed[:len(free)]]
    for (kind, params), out in zip(KINDS.items(), mixed[len(free):]):
        ids = out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "stop", (kind, ids)
        assert reference(params, ids), (kind, ids)
    # WHY decode alone: the streamed text of a random prompt may start with the
    # prompt's split UTF-8 bytes.
    texts = [tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in mixed[len(free):]]
    assert json.loads(texts[0]).keys() == {"ok", "n"} and isinstance(json.loads(texts[1]), dict)
    assert re.fullmatch(REGEX, texts[2]) and texts[3] in ("left", "right", "up")


def test_n_samples_each_follow_the_grammar(path, reference):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=64, structured_outputs=KINDS["regex"])
    with LLM(str(path)) as llm:
        (out,) = llm.generate(_prompts(1, seed=1), params)
    samples = [c.token_ids for c in out.outputs]
    assert len(samples) == 4 and len({tuple(s) for s in samples}) > 1
    assert all(reference(KINDS["regex"], s) for s in samples), samples


BLOCK_SIZE = 8
PREEMPT_ENGINE = dict(block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.mark.heavy
def test_preemption_keeps_the_matchers(path, reference):
    """8 seeded constrained requests on a 12-block cache: recompute and swap
    preemption give the tokens of a run that never preempts, all valid."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs=KINDS["json"])
              for i in range(8)]
    prompts = _prompts(8, seed=2)
    block_bytes = EngineConfig.build(model=str(path), block_size=BLOCK_SIZE, num_blocks=2).resolve().kv_block_bytes

    def run(**engine):
        with LLM(str(path), **PREEMPT_ENGINE, **engine) as llm:
            outs = llm.generate(prompts, params)
            return [o.outputs[0].token_ids for o in outs], llm.get_stats()

    expected, stats = run(num_blocks=256)
    assert stats.num_preempted_total == 0
    assert all(reference(KINDS["json"], ids) for ids in expected), expected
    recomputed, stats = run(num_blocks=12)
    assert stats.num_preempted_total > 0 and recomputed == expected
    swapped, stats = run(num_blocks=12, kv_host_bytes=f"{64 * block_bytes}B", preemption_mode="swap")
    assert stats.num_swapped_out_total > 0 and swapped == expected
