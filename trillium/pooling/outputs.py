"""What the api knows of a pooling model, and the per-request parts of pooling.

    PoolingModel.build(engine_config)     task, labels, hidden size, Matryoshka sizes
    model.embedding(raw, dimensions, normalize) -> list[float]
    model.classification(raw, use_activation)    -> list[float]
    cosine(a, b)                                  the score of two embeddings

The engine returns each request's raw output (the pooled hidden state, or a
classifier's logits; `actors/executor/pooler.py`); the parameters a request
may set on top are applied here, in vLLM's order
(vllm/model_executor/layers/pooler/seqwise/heads.py): an embedding is cut
to `dimensions` (Matryoshka) and then L2-normalized; a classifier's logits
go through softmax, or sigmoid for a single label (activations.py
PoolerClassify). `use_activation` false (vLLM's name; `normalize` for
embeddings) returns them as they are. Token pooling (ALL / STEP) hands in
[rows, width]: each row is cut, normalized or activated on its own. `dimensions` is refused, as vLLM
refuses it (vllm/pooling_params.py), for a model whose config.json does not
say it was trained for it (`is_matryoshka` / `matryoshka_dimensions`).
A request's task (`check_task`) is the model's or its per-token one
(`PoolerConfig.supported_tasks`); either is post-processed the same way, row by row.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np

from trillium.pooling.config import PoolerConfig


@attrs.frozen
class PoolingModel:
    pooler: PoolerConfig
    hidden_size: int
    labels: tuple[str, ...] = ()  # classifiers: id2label in id order
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()  # () with is_matryoshka: any size up to hidden_size

    @property
    def task(self) -> str:
        return self.pooler.task

    @property
    def is_token_pooling(self) -> bool:
        """ALL / STEP: one output row per prompt token, served by /pooling only."""
        return self.pooler.is_token_pooling

    @staticmethod
    def build(engine_config) -> "PoolingModel | None":
        """From a resolved EngineConfig (None for a generative one) and the model's config.json."""
        if engine_config.runner != "pooling":
            return None
        from trillium.models.loader import load_model_config

        model_config = load_model_config(engine_config.model)
        config_path = Path(engine_config.model) / "config.json"
        hf = json.loads(config_path.read_text()) if config_path.exists() else {}
        id2label = hf.get("id2label") or {}
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(model_config.num_labels))
        dims = tuple(int(d) for d in hf.get("matryoshka_dimensions") or ())
        return PoolingModel(
            pooler=PoolerConfig.from_json(engine_config.pooler_config), hidden_size=model_config.hidden_size,
            labels=labels, is_matryoshka=bool(dims) or bool(hf.get("is_matryoshka")), matryoshka_dimensions=dims,
        )

    def check_task(self, task: str) -> str:
        """`task` when this model serves it; ValueError naming it, vLLM's message
        (vllm/entrypoints/pooling/pooling/serving.py), otherwise."""
        supported = self.pooler.supported_tasks
        if task not in supported:
            raise ValueError(f"Unsupported task: {task!r} Supported tasks: {supported}")
        return task

    def check_dimensions(self, dimensions: int | None, model_name: str) -> None:
        """ValueError (vLLM's messages) when `dimensions` cannot be served."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError(f'dimensions: model "{model_name}" does not support matryoshka representation, '
                             "changing output dimensions will lead to poor results.")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f'dimensions: model "{model_name}" only supports {list(self.matryoshka_dimensions)} '
                             "matryoshka dimensions, use other output dimensions will lead to poor results.")
        if not 0 < dimensions <= self.hidden_size:
            raise ValueError(f"dimensions: must be in [1, {self.hidden_size}]")

    def embedding(self, raw: np.ndarray, dimensions: int | None = None, normalize: bool | None = None) -> np.ndarray:
        size = dimensions or self.pooler.dimensions
        vec = np.asarray(raw, dtype=np.float32)  # [size] or, token pooling, [rows, size]: per row
        if size is not None:
            vec = vec[..., :size]
        if self.pooler.use_activation if normalize is None else normalize:
            norm = np.linalg.norm(vec, axis=-1, keepdims=True)
            vec = vec / np.maximum(norm, 1e-12)  # torch F.normalize's eps
        return vec

    def classification(self, raw: np.ndarray, use_activation: bool | None = None) -> np.ndarray:
        logits = np.asarray(raw, dtype=np.float64)
        if not (self.pooler.use_activation if use_activation is None else use_activation):
            return logits.astype(np.float32)
        if logits.shape[-1] < 2:
            return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))  # per row under token pooling
        return (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)

    def output(self, raw: np.ndarray, *, dimensions: int | None = None, use_activation: bool | None = None):
        """The task's output of one request (embedding or class scores)."""
        if self.task == "embed":
            return self.embedding(raw, dimensions, use_activation)
        return self.classification(raw, use_activation)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a64 @ b64 / max(np.linalg.norm(a64) * np.linalg.norm(b64), 1e-12))
