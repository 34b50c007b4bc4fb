"""The pooling seams, unit by unit: flag resolution, the api's post-processing,
the executor's pooling head, the messages, and the scheduler finishing a
pooling request like any max_tokens=1 prompt.

Semantics mirrored: vllm/config/pooler.py (pooling_type LAST / MEAN / CLS,
use_activation), vllm/model_executor/layers/pooler/seqwise/heads.py (cut to
`dimensions` before normalizing), activations.py (PoolerClassify: sigmoid
below two labels, else softmax), vllm/pooling_params.py (dimensions refused
unless the model is Matryoshka-trained).
"""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import numpy as np
import pytest
import torch

from support.scheduler_harness import add_req
from trillium.actors.assembly import engine_codec
from trillium.actors.executor.pooler import POOLED_TOKEN_ID, PoolingHead
from trillium.actors.protocol.execute import BatchResult
from trillium.actors.protocol.outputs import RequestDelta, RequestOutputDelta
from trillium.actors.scheduler.core import Scheduler, SchedulerConfig
from trillium.models.config import ModelConfig
from trillium.models.synthetic import hf_config_dict
from trillium.pooling.config import PoolerConfig, resolve_pooler
from trillium.pooling.outputs import PoolingModel


def _config(variant: str) -> ModelConfig:
    return ModelConfig.from_hf_config(hf_config_dict(variant))


def test_pooling_checkpoints_keep_their_family_flags():
    reward = _config("qwen3-reward")
    assert (reward.architecture, reward.family_architecture) == ("Qwen3ForSequenceClassification", "Qwen3ForCausalLM")
    assert reward.qk_norm and reward.num_labels == 1
    assert _config("llama-classify").num_labels == 3
    embed = _config("qwen3-embed")
    assert embed.num_labels == 0 and embed.qk_norm


@pytest.mark.parametrize("runner, convert, pooler, variant, expected", [
    ("auto", "auto", "", "llama-classify", ("pooling", "classify", "LAST", True, False)),
    ("auto", "reward", "", "qwen3-reward", ("pooling", "classify", "LAST", False, True)),
    ("auto", "auto", '{"pooling_type": "MEAN", "normalize": false}', "qwen3-embed",
     ("pooling", "embed", "MEAN", False, False)),
    ("pooling", "embed", "", "qwen3", ("pooling", "embed", "LAST", True, False)),  # a causal LM as a backbone
    ("auto", "auto", '{"pooling_type": "STEP", "step_tag_id": 5, "returned_token_ids": [0]}', "qwen3-reward",
     ("pooling", "classify", "STEP", True, False)),
    ("auto", "auto", '{"pooling_type": "ALL"}', "qwen3-embed", ("pooling", "embed", "ALL", True, False)),
    ("auto", "auto", '{"task": "token_classify"}', "qwen3-reward", ("pooling", "classify", "ALL", True, False)),
])
def test_resolve_pooler(runner, convert, pooler, variant, expected):
    resolved, config = resolve_pooler(runner, convert, pooler, _config(variant))
    assert (resolved, config.task, config.pooling_type, config.use_activation, config.reward) == expected
    again = resolve_pooler(resolved, "auto", config.to_json(), _config(variant))  # resolving twice is stable
    assert again == (resolved, config)


def test_supported_and_default_tasks():
    """vllm/model_executor/layers/pooler/special.py DispatchPooler: embed + token_embed, or
    classify + token_classify; per token by default under ALL / STEP."""
    embed, step = PoolerConfig(task="embed"), PoolerConfig(task="classify", pooling_type="STEP")
    assert (embed.supported_tasks, embed.default_task) == (("embed", "token_embed"), "embed")
    assert (step.supported_tasks, step.default_task) == (("classify", "token_classify"), "token_classify")
    assert (step.sequence_pooling_type, step.token_pooling_type) == ("LAST", "STEP")


def test_resolve_pooler_generate_and_refusals():
    assert resolve_pooler("auto", "auto", "", _config("llama")) == ("generate", None)
    cases = [
        (("generate", "auto", "", "llama-classify"), "no LM head"),
        (("auto", "auto", '{"pooling_type": "SPLADE"}', "qwen3-embed"), "pooling_type 'SPLADE'"),
        (("auto", "auto", '{"step_tag_id": 3}', "qwen3-embed"), "step_tag_id: needs pooling_type STEP"),
        (("auto", "auto", '{"pooling_type": "STEP", "returned_token_ids": [1]}', "qwen3-reward"),
         r"returned_token_ids: .* in \[0, 1\)"),
        (("auto", "auto", '{"pooling_type": "STEP", "step_tag_id": -1}', "qwen3-reward"), "step_tag_id: a token id"),
        (("auto", "auto", '{"bogus": 3}', "qwen3-embed"), "unsupported key"),
        (("auto", "auto", "[1]", "qwen3-embed"), "JSON object"),
        (("auto", "classify", "", "qwen3-embed"), "needs a \\*ForSequenceClassification"),
        (("pooling", "auto", "", "qwen3-moe"), "not supported"),
        (("auto", "auto", '{"task": "token_embed", "pooling_type": "MEAN"}', "qwen3-embed"), "ALL or STEP"),
        (("auto", "auto", '{"task": "plugin"}', "qwen3-embed"), "task 'plugin'"),
        (("generate", "embed", "", "llama"), "need --runner pooling"),
    ]
    for (runner, convert, pooler, variant), match in cases:
        with pytest.raises(ValueError, match=match):
            resolve_pooler(runner, convert, pooler, _config(variant))


def _model(task: str, **kw) -> PoolingModel:
    return PoolingModel(pooler=PoolerConfig(task=task), hidden_size=4, **kw)


def test_token_rows_are_processed_one_by_one():
    embed = _model("embed", is_matryoshka=True)
    rows = np.array([[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]], np.float32)
    np.testing.assert_allclose(embed.embedding(rows), [[0.6, 0.8, 0, 0], [0, 0, 0, 1]], rtol=1e-6)
    np.testing.assert_allclose(embed.embedding(rows, dimensions=1), [[1.0], [0.0]])
    classify = _model("classify", labels=("a", "b"))
    np.testing.assert_allclose(classify.classification(np.array([[0.0, np.log(3.0)], [0.0, 0.0]])),
                               [[0.25, 0.75], [0.5, 0.5]], rtol=1e-6)


def test_outputs_cut_then_normalize_and_activations():
    embed = _model("embed", is_matryoshka=True)
    raw = np.array([3.0, 4.0, 12.0, 0.0], np.float32)
    np.testing.assert_allclose(embed.embedding(raw), raw / 13.0, rtol=1e-6)
    np.testing.assert_allclose(embed.embedding(raw, dimensions=2), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(embed.embedding(raw, normalize=False), raw)
    classify = _model("classify", labels=("a", "b"))
    np.testing.assert_allclose(classify.classification(np.array([0.0, np.log(3.0)])), [0.25, 0.75], rtol=1e-6)
    np.testing.assert_allclose(classify.classification(np.array([0.0])), [0.5])  # one label: sigmoid
    np.testing.assert_allclose(classify.classification(np.array([2.0, 1.0]), use_activation=False), [2.0, 1.0])


def test_dimensions_need_a_matryoshka_model():
    with pytest.raises(ValueError, match="does not support matryoshka"):
        _model("embed").check_dimensions(2, "m")
    with pytest.raises(ValueError, match=r"only supports \[2\]"):
        _model("embed", is_matryoshka=True, matryoshka_dimensions=(2,)).check_dimensions(3, "m")
    _model("embed", is_matryoshka=True).check_dimensions(4, "m")


class _Identity:
    @staticmethod
    def pool_head(pooled):
        return pooled.float()


def _sampling(task: str | None = None) -> SimpleNamespace:
    """What the pooling head reads of a request's sampling state: its pooling task."""
    return SimpleNamespace(params=SimpleNamespace(pooling_task=task))


@attrs.define
class _State:
    request_id: str
    num_computed_tokens: int
    num_prompt_tokens: int
    sampling: SimpleNamespace = attrs.Factory(_sampling)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_pooling_head_over_chunks(pooling_type):
    """A 5-token prompt in chunks of 3 + 2 beside a 2-token one: the same as pooling it whole."""
    rows = torch.arange(14, dtype=torch.float32).reshape(7, 2)  # prompt A: rows 0-4, B: rows 5-6
    head = PoolingHead(PoolerConfig(task="embed", pooling_type=pooling_type), _Identity())
    a, b = _State("a", 0, 5), _State("b", 0, 2)
    head.observe(torch.cat([rows[0:3], rows[5:7]]), [a, b], [3, 2])
    done_b = head.finish(torch.cat([rows[0:3], rows[5:7]]), [4], [b])
    a.num_computed_tokens = 3
    head.observe(rows[3:5], [a], [2])
    done_a = head.finish(rows[3:5], [1], [a])
    pick = {"LAST": lambda r: r[-1], "MEAN": lambda r: r.mean(0), "CLS": lambda r: r[0]}[pooling_type]
    np.testing.assert_allclose(done_a[0], pick(rows[0:5]).numpy())
    np.testing.assert_allclose(done_b[0], pick(rows[5:7]).numpy())
    head.drop(["a", "b"])
    assert not head._sums and not head._first


@attrs.define
class _TokenState:
    request_id: str
    num_computed_tokens: int
    num_prompt_tokens: int
    token_ids: list[int]
    sampling: SimpleNamespace = attrs.Factory(_sampling)


@pytest.mark.parametrize("pooler", [
    PoolerConfig(task="embed", pooling_type="ALL"),
    PoolerConfig(task="classify", pooling_type="STEP", step_tag_id=7, returned_token_ids=(1,)),
    PoolerConfig(task="classify", pooling_type="STEP", step_tag_id=7),
])
def test_token_pooling_over_chunks(pooler):
    """vllm/model_executor/layers/pooler/tokwise/methods.py: ALL keeps every prompt row across
    chunks; STEP then keeps the returned_token_ids columns and the rows of step_tag_id."""
    rows = torch.arange(14, dtype=torch.float32).reshape(7, 2)  # prompt A: rows 0-4, B: rows 5-6
    head = PoolingHead(pooler, _Identity())
    a, b = _TokenState("a", 0, 5, [7, 1, 7, 2, 7]), _TokenState("b", 0, 2, [3, 3])
    head.observe(torch.cat([rows[0:3], rows[5:7]]), [a, b], [3, 2])
    done_b = head.result_fields(torch.cat([rows[0:3], rows[5:7]]), [4], [b])
    a.num_computed_tokens = 3
    head.observe(rows[3:5], [a], [2])
    done_a = head.result_fields(rows[3:5], [1], [a])
    keep_rows = [0, 2, 4] if pooler.step_tag_id is not None else list(range(5))
    keep_cols = list(pooler.returned_token_ids or (0, 1))
    np.testing.assert_array_equal(done_a["pooled"], rows[0:5][keep_rows][:, keep_cols].numpy())
    np.testing.assert_array_equal(done_a["pooled_row_offsets"], [0, len(keep_rows)])
    want_b = rows[5:7][:, keep_cols] if pooler.step_tag_id is None else rows[5:7][:0, keep_cols]  # no step tag in B
    np.testing.assert_array_equal(done_b["pooled"], want_b.numpy())
    assert not head._chunks


def test_a_batch_mixes_sequence_and_token_tasks():
    """vllm/model_executor/layers/pooler/special.py DispatchPooler: each request's task picks its
    pooler; a token task under a MEAN server keeps every row (ALL), the others are MEANs. The
    scheduler skips prefix-cache reads for token tasks (vllm/pooling_params.py
    skip_reading_prefix_cache)."""
    rows = torch.arange(14, dtype=torch.float32).reshape(7, 2)
    head = PoolingHead(PoolerConfig(task="embed", pooling_type="MEAN"), _Identity())
    a = _TokenState("a", 0, 5, [1] * 5, _sampling("token_embed"))
    b = _TokenState("b", 0, 2, [2, 2], _sampling("embed"))
    head.observe(torch.cat([rows[0:5], rows[5:7]]), [a, b], [5, 2])
    done = head.result_fields(torch.cat([rows[0:5], rows[5:7]]), [4, 6], [a, b])
    np.testing.assert_array_equal(done["pooled_row_offsets"], [0, 5, 6])
    np.testing.assert_array_equal(done["pooled"][:5], rows[0:5].numpy())
    np.testing.assert_array_equal(done["pooled"][5], rows[5:7].mean(0).numpy())
    assert not head._chunks and not head._sums
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=16))
    for rid, task in (("t", "token_embed"), ("s", "embed")):
        sched.add_request(add_req(rid, range(1, 10), max_tokens=1, temperature=0.0, pooling_task=task))
    assert {r.request_id: r.reads_prefix_cache for r in sched.waiting_requests()} == {"t": False, "s": True}


def test_scheduler_hands_each_request_its_token_rows():
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=16))
    sched.add_request(add_req("p", range(1, 4), max_tokens=1, temperature=0.0))
    sched.add_request(add_req("q", range(1, 3), max_tokens=1, temperature=0.0))
    step = sched.schedule()
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)
    deltas = sched.update_from_output(BatchResult(
        step_id=step.step_id, request_ids=("p", "q"), sampled_token_ids=np.array([POOLED_TOKEN_ID] * 2, np.int32),
        pooled_request_ids=("p", "q"), pooled=rows, pooled_row_offsets=np.array([0, 3, 5])))
    by_id = {d.request_id: d.pooled for d in deltas.deltas}
    np.testing.assert_array_equal(by_id["p"], rows[:3])
    np.testing.assert_array_equal(by_id["q"], rows[3:])
    codec = engine_codec()
    back = codec.decode(codec.encode(deltas.deltas[0]))
    np.testing.assert_array_equal(back.pooled, deltas.deltas[0].pooled)


def test_pooled_arrays_cross_the_codec():
    codec = engine_codec()
    pooled = np.arange(2 * 5000, dtype=np.float32).reshape(2, 5000)  # large: extra frames
    result = BatchResult(step_id=3, request_ids=("a", "b"), sampled_token_ids=np.zeros(2, np.int32),
                         pooled_request_ids=("a", "b"), pooled=pooled)
    back = codec.decode(codec.encode(result))
    assert back.pooled_request_ids == ("a", "b")
    np.testing.assert_array_equal(back.pooled, pooled)
    for message in (RequestDelta("a", (0,), "length", pooled=pooled[0]),
                    RequestOutputDelta("a", "", (0,), True, pooled=pooled[1, :3].copy()), RequestDelta("b", (1,))):
        again = codec.decode(codec.encode(message))
        if message.pooled is None:
            assert again.pooled is None
        else:
            np.testing.assert_array_equal(again.pooled, message.pooled)


def test_scheduler_finishes_a_pooling_request_after_its_prompt():
    """No pooling branch in the scheduler: max_tokens=1, the placeholder token, the pooled vector passed on."""
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=6))
    sched.add_request(add_req("p", range(1, 11), max_tokens=1, temperature=0.0))
    first = sched.schedule()  # 6 of the 10 prompt tokens
    deltas = sched.update_from_output(BatchResult(step_id=first.step_id, request_ids=("p",),
                                                  sampled_token_ids=np.array([-1], np.int32)))
    assert deltas.deltas == ()
    second = sched.schedule()
    vector = np.array([[0.5, -1.0, 2.0]], np.float32)
    deltas = sched.update_from_output(BatchResult(
        step_id=second.step_id, request_ids=("p",), sampled_token_ids=np.array([POOLED_TOKEN_ID], np.int32),
        pooled_request_ids=("p",), pooled=vector))
    (delta,) = deltas.deltas
    assert delta.finish_reason == "length"
    np.testing.assert_array_equal(delta.pooled, vector[0])
    assert sched.num_running == 0 and sched.num_free_blocks == 16
