"""LLM.embed / classify / reward / score: the offline API of a pooling model (vLLM's names).

    encode(prompts, *, pooling_task, dimensions=None, use_activation=None)
                                                        -> [PoolingRequestOutput]     .outputs.data
                                                           (token tasks: a row per prompt token)
    embed(prompts, *, dimensions=None, normalize=None)  -> [EmbeddingRequestOutput]   .outputs.embedding
    classify(prompts, *, use_activation=None)           -> [ClassificationRequestOutput] .outputs.probs
    reward(prompts)                                     -> [PoolingRequestOutput]     .outputs.data (raw)
    score(data_1, data_2)                               -> [ScoringRequestOutput]     .outputs.score

Output classes and fields follow vllm/outputs.py. `score` pairs data_1 with
data_2 as vLLM does (one with many, or element-wise): a classifier
(cross-encoder) scores each pair encoded as one text pair (the tokenizer's
pair template), with sigmoid on its one label; an embedding model scores
the cosine of the two embeddings.

Every prompt is one engine request through the shared scheduler
(`trillium/pooling/__init__.py`): SamplingParams(max_tokens=1), read back
as the finishing delta's `pooled` array.
"""

from __future__ import annotations

import attrs
import numpy as np
import trio

from trillium.pooling.outputs import PoolingModel, cosine
from trillium.sampling_params import SamplingParams
from trillium.validation import check_request

# One "token": the step that would sample answers with the pooled output instead.
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
_TASK_PARAMS = {task: attrs.evolve(POOLING_PARAMS, pooling_task=task)
                for task in ("embed", "classify", "token_embed", "token_classify")}


def pooling_params(task: str | None) -> SamplingParams:
    """The engine request of one prompt pooled for `task` (None: the server's default task)."""
    return POOLING_PARAMS if task is None else _TASK_PARAMS[task]


def engine_output(raw: np.ndarray, task: str) -> np.ndarray:
    """A request's raw output as its task reads it: a sequence task's one row (a batch that
    mixed in a token task hands it as [1, width]), a token task's [rows, width]."""
    return raw if task.startswith("token_") else np.asarray(raw).reshape(-1)


@attrs.define
class EmbeddingOutput:
    embedding: list[float]


@attrs.define
class ClassificationOutput:
    probs: list[float]


@attrs.define
class ScoringOutput:
    score: float


@attrs.define
class PoolingOutput:
    data: list[float] | list[list[float]]  # token tasks: a row per prompt token


@attrs.define
class PoolingRequestOutput:
    """vLLM's PoolingRequestOutput and its Embedding / Classification / Scoring kinds (by `outputs`)."""

    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    finished: bool = True


EmbeddingRequestOutput = ClassificationRequestOutput = ScoringRequestOutput = PoolingRequestOutput


def pair_list(data_1, data_2) -> list[tuple[str, str]]:
    """vLLM's score pairing: 1 x N, N x 1 or N x N element-wise; ValueError otherwise."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValueError("score: data_1 and data_2 must not be empty")
    if len(first) == 1:
        first = first * len(second)
    if len(second) == 1:
        second = second * len(first)
    if len(first) != len(second):
        raise ValueError(f"score: {len(first)} and {len(second)} texts cannot be paired (give 1 and N, or N and N)")
    return list(zip(first, second))


class PoolingRunner:
    """The pooling half of `trillium.LLM` (it holds one); all calls from the caller's thread."""

    def __init__(self, llm) -> None:
        self._llm = llm
        self.model = PoolingModel.build(llm.config)

    def _need(self, task: str, method: str) -> PoolingModel:
        if self.model is None:
            raise ValueError(f"{method}: this LLM serves a generative model; build it with runner='pooling'")
        if self.model.task != task:
            raise ValueError(f"{method}: this model's pooling task is {self.model.task!r}, not {task!r}")
        if self.model.is_token_pooling:
            raise ValueError(f"{method}: this model pools per token (pooling_type "
                             f"{self.model.pooler.pooling_type}); serve it and use /pooling")
        return self.model

    def run(self, prompts: list[list[int]], task: str | None = None) -> list[np.ndarray]:
        """Raw engine outputs of token-id prompts pooled for `task` (None: the model's task), in order."""
        llm = self._llm
        task = task or self.model.task
        params = pooling_params(task)
        for ids in prompts:
            check_request(ids, params, vocab_size=llm.model_vocab_size, max_model_len=llm.config.max_model_len)
        return [engine_output(raw, task) for raw in llm._call(self._run_async, prompts, params)]

    async def _run_async(self, prompts: list[list[int]], params: SamplingParams) -> list[np.ndarray]:
        results: list[np.ndarray | None] = [None] * len(prompts)
        client = self._llm._client

        async def one(index: int, ids: list[int]) -> None:
            (stream,) = await client.generate(f"pool-{next(self._llm._ids)}", ids, params, ())
            async for delta in stream:
                if delta.pooled is not None:
                    results[index] = delta.pooled
                if delta.finished and results[index] is None:
                    raise RuntimeError(f"pooling request ended without an output ({delta.finish_reason}: "
                                       f"{delta.stop_reason})")

        async with trio.open_nursery() as nursery:
            for index, ids in enumerate(prompts):
                nursery.start_soon(one, index, ids)
        return results  # type: ignore[return-value]

    def _ids(self, prompts) -> list[list[int]]:
        return [ids for _, ids in self._llm._normalize_prompts(prompts)]

    def encode(self, prompts, *, pooling_task: str | None = None, dimensions: int | None = None,
               use_activation: bool | None = None):
        """vLLM's LLM.encode (vllm/entrypoints/pooling/llm.py): `pooling_task` is required, one
        of the model's tasks (embed + token_embed, or classify + token_classify)."""
        if self.model is None:
            raise ValueError("LLM.encode() is only supported for pooling models; build it with runner='pooling'")
        supported = self.model.pooler.supported_tasks
        if pooling_task is None:
            raise ValueError(f"encode: pooling_task is required, one of {supported} (or use embed / classify)")
        model = self.model
        model.check_task(pooling_task)
        if model.task == "embed":
            model.check_dimensions(dimensions, self._llm.config.served_model_name)
        elif dimensions is not None:
            raise ValueError(f"encode: task {pooling_task!r} has no size to cut (dimensions)")
        ids = self._ids(prompts)
        data = [model.output(raw, dimensions=dimensions, use_activation=use_activation).tolist()
                for raw in self.run(ids, pooling_task)]
        return [PoolingRequestOutput(f"encode-{i}", PoolingOutput(d), p) for i, (d, p) in enumerate(zip(data, ids))]

    def embed(self, prompts, *, dimensions: int | None = None, normalize: bool | None = None):
        model = self._need("embed", "embed")
        model.check_dimensions(dimensions, self._llm.config.served_model_name)
        ids = self._ids(prompts)
        vectors = [model.embedding(raw, dimensions, normalize).tolist() for raw in self.run(ids)]
        return [PoolingRequestOutput(f"embd-{i}", EmbeddingOutput(v), p) for i, (v, p) in enumerate(zip(vectors, ids))]

    def classify(self, prompts, *, use_activation: bool | None = None):
        model = self._need("classify", "classify")
        ids = self._ids(prompts)
        probs = [model.classification(raw, use_activation).tolist() for raw in self.run(ids)]
        return [PoolingRequestOutput(f"classify-{i}", ClassificationOutput(v), p)
                for i, (v, p) in enumerate(zip(probs, ids))]

    def reward(self, prompts):
        self._need("classify", "reward")
        ids = self._ids(prompts)
        return [PoolingRequestOutput(f"reward-{i}", PoolingOutput(np.asarray(r, np.float32).tolist()), p)
                for i, (r, p) in enumerate(zip(self.run(ids), ids))]

    def score(self, data_1, data_2, *, use_activation: bool | None = None):
        if self.model is None:
            raise ValueError("score: this LLM serves a generative model; build it with runner='pooling'")
        self._need(self.model.task, "score")
        pairs = pair_list(data_1, data_2)
        tokenizer = self._llm.tokenizer
        if self.model.task == "embed":
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            vectors = dict(zip(texts, self.run([tokenizer.encode(t) for t in texts])))
            scores = [cosine(vectors[a], vectors[b]) for a, b in pairs]
            ids = [tokenizer.encode(a) + tokenizer.encode(b) for a, b in pairs]
        else:
            check_cross_encoder(self.model)
            ids = [tokenizer.encode_pair(a, b) for a, b in pairs]
            scores = [float(self.model.classification(r, use_activation)[0]) for r in self.run(ids)]
        return [PoolingRequestOutput(f"score-{i}", ScoringOutput(s), p) for i, (s, p) in enumerate(zip(scores, ids))]


def check_cross_encoder(model: PoolingModel) -> None:
    if len(model.labels) != 1:
        raise ValueError(f"score: a cross-encoder has one label; this classifier has {len(model.labels)}")


__all__ = ["PoolingRunner", "PoolingRequestOutput", "EmbeddingOutput", "ClassificationOutput", "ScoringOutput",
           "PoolingOutput", "pair_list", "check_cross_encoder"]
