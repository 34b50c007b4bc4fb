"""An n > 1 request crosses each link once (ISSUE 16 item 3).

api -> scheduler: one AddRequest whose `sampling.n` choices the scheduler
expands into `<id>-<i>` (seed + i, as vllm/v1/engine/parallel_sampling.py
numbers child requests and seeds them); the choices share the message's
prompt array and stop tuple (no copies). scheduler -> executor: no stop
strings at all (only the detokenizer matches them). scheduler ->
detokenizer: the spec on the first delta of the group that goes out
(GroupSpecs), whatever order the loop sends them in; the detokenizer
gives every choice the spec and forgets it after the last one.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from support.scheduler_harness import Harness, add_req
from trillium.actors.detokenizer.core import DetokenizerRegistry
from trillium.actors.protocol.outputs import DetokenizeSpec, RequestDelta, TokenDeltas
from trillium.actors.scheduler.group_specs import GroupSpecs

STOPS = tuple(f"never-{i}" for i in range(100))


def test_one_add_request_becomes_n_choices_sharing_its_data():
    h = Harness()
    msg = add_req("r", range(10), max_tokens=3, n=3, seed=7, stop=STOPS, temperature=1.0)
    h.sched.add_request(msg)
    h.run()
    assert sorted(h.deltas) == ["r-0", "r-1", "r-2"]
    # the executor never sees the stop strings
    assert all(new.sampling.stop == () for b in h.batches for new in b.new_requests)
    firsts = [h.deltas[f"r-{i}"][0] for i in range(3)]
    assert all(d.group_id == "r" and d.spec.num_choices == 3 and d.spec.stop is msg.sampling.stop for d in firsts)
    children = msg.choices()
    assert [c.sampling.seed for c in children] == [7, 8, 9]
    assert all(c.prompt_token_ids is msg.prompt_token_ids and c.sampling.stop is msg.sampling.stop for c in children)


def test_a_refused_group_is_refused_whole():
    h = Harness(num_blocks=4)  # 16 tokens of KV: a 10-token prompt + 30 tokens never fit
    msg = add_req("big", range(10), max_tokens=30, n=2)
    with pytest.raises(ValueError):
        h.sched.add_request(msg)
    assert not h.sched.has_work()
    assert msg.choice_ids() == ("big-0", "big-1")


def _delta(rid, group, spec=None):
    return RequestDelta(request_id=rid, new_token_ids=(5,), spec=spec, group_id=group)


def _spec(n, stop=("xyz",)):
    return DetokenizeSpec(prompt_token_ids=np.asarray([1, 2], dtype=np.int32), skip_special_tokens=True,
                          stop=stop, include_stop_str_in_output=False, num_choices=n)


def test_group_spec_goes_out_once_in_sending_order():
    specs = GroupSpecs()
    spec = _spec(3)
    # the loop may send choice 2's abort delta before the step deltas of choices 0 and 1
    first = specs.once(TokenDeltas(1, (_delta("g-2", "g", spec),)))
    later = specs.once(TokenDeltas(2, (_delta("g-0", "g", spec), _delta("g-1", "g", spec), _delta("solo", None))))
    assert first.deltas[0].spec is spec
    assert [d.spec for d in later.deltas[:2]] == [None, None] and len(specs) == 0


def _bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["the quick brown fox xyz jumps", "hello world xyz"] * 20,
                                  trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def test_detokenizer_shares_one_spec_between_choices_and_forgets_it():
    tokenizer = _bpe()
    ids = tokenizer.encode("hello xyz world").ids
    registry = DetokenizerRegistry(tokenizer)
    spec = _spec(2, stop=("xyz",))
    step = TokenDeltas(0, tuple(attrs.evolve(_delta(f"g-{i}", "g", spec if i == 0 else None),
                                             new_token_ids=tuple(ids)) for i in range(2)))
    outputs, finish = registry.process(step)
    assert [o.text for o in outputs.deltas] == ["hello ", "hello "]
    assert all(o.finish_reason == "stop" and o.stop_reason == "xyz" for o in outputs.deltas)
    assert finish.request_ids == ("g-0", "g-1")
    assert registry.num_groups == 0
