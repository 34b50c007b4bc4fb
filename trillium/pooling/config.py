"""--runner / --convert / --pooler-config: which pooling a server does, resolved once.

    resolve_pooler(runner, convert, pooler_json, model_config) -> (runner, PoolerConfig | None)

Semantics follow vLLM (vllm/config/pooler.py, vllm/model_executor/layers/
pooler/seqwise/heads.py, activations.py):

    runner    auto | generate | pooling. auto: pooling when the checkpoint's
              architecture is a pooling one (*ForSequenceClassification,
              *Model), else generate.
    convert   auto | embed | classify | reward (pooling runner only). auto:
              classify for a *ForSequenceClassification checkpoint, embed
              otherwise (a *Model or a *ForCausalLM read as its backbone).
              reward: a classify head whose default is the raw score
              (use_activation false), as RLHF reward models are read.
    pooler    JSON: {"pooling_type": "LAST" | "MEAN" | "CLS" | "ALL" | "STEP", "use_activation":
              bool (embed: L2-normalize; classify: softmax, or sigmoid for one
              label), "normalize": alias of use_activation for embed,
              "dimensions": default Matryoshka size, "task" (embed | classify |
              token_embed | token_classify: the default task of a request, a token
              one meaning ALL unless STEP), STEP's "step_tag_id" and
              "returned_token_ids"}. Defaults: LAST, activation on (off for reward).
              Any other key is an error. (`reward`: true is what --convert reward
              resolves to.)

Token pooling (vllm/model_executor/layers/pooler/tokwise/methods.py AllPool,
StepPool): ALL answers one output row per prompt token (the hidden state, or
the score head's logits); STEP keeps the columns `returned_token_ids`
(indices into a row: the labels of a process reward model's head) and the
rows whose prompt token is `step_tag_id`, either one optional. Both are
served by /pooling only (`is_token_pooling`).

Per-request tasks (vllm/tasks.py, vllm/entrypoints/pooling/pooling/serving.py):
a model serves its task and the per-token one (`supported_tasks`: embed +
token_embed, classify + token_classify). /pooling's `task` and LLM.encode's
`pooling_task` pick one per request; a token task pools as
`token_pooling_type` (STEP when configured, else ALL), a sequence task as
`sequence_pooling_type` (LAST under ALL / STEP). The task rides
`SamplingParams.pooling_task` to the executor's pooling head.

`PoolerConfig` crosses to the actors inside `EngineConfig.pooler_config` as
its JSON (`to_json`), so every process agrees on it.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from trillium.models.config_families import pooling_base

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "embed", "classify", "reward")
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")
TOKEN_POOLING_TYPES = ("ALL", "STEP")
TASKS = ("embed", "classify")
# vLLM's pooling tasks (vllm/tasks.py PoolingTask) a request may ask for on /pooling and LLM.encode;
# a model serves its task and the per-token one (vllm/model_executor/layers/pooler/special.py
# DispatchPooler.for_embedding / for_seq_cls).
TOKEN_TASKS = {"embed": "token_embed", "classify": "token_classify"}
# Dense Llama-family backbones a pooling head sits on (MoE and Gemma are not wired).
POOLING_BASES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ACCEPTED_KEYS = frozenset({"pooling_type", "seq_pooling_type", "use_activation", "normalize", "dimensions",
                            "task", "activation", "softmax", "reward", "step_tag_id", "returned_token_ids"})


@attrs.frozen
class PoolerConfig:
    task: str  # embed | classify
    pooling_type: str = "LAST"
    use_activation: bool = True  # the default of requests that do not say
    dimensions: int | None = None  # default Matryoshka size (None: the full hidden size)
    reward: bool = False  # --convert reward: a classifier read as a raw score
    step_tag_id: int | None = None  # STEP: keep the rows of this prompt token (None: every row)
    returned_token_ids: tuple[int, ...] | None = attrs.field(  # STEP: keep these columns (None: all)
        default=None, converter=lambda v: None if v is None else tuple(v))

    @property
    def is_token_pooling(self) -> bool:
        """One output row per prompt token (ALL, STEP), not one vector per prompt."""
        return self.pooling_type in TOKEN_POOLING_TYPES

    @property
    def supported_tasks(self) -> tuple[str, str]:
        """The pooling tasks this model serves: its task and its per-token one."""
        return self.task, TOKEN_TASKS[self.task]

    @property
    def default_task(self) -> str:
        """The task of a request that names none: per token under ALL / STEP."""
        return TOKEN_TASKS[self.task] if self.is_token_pooling else self.task

    @property
    def token_pooling_type(self) -> str:
        """How a token task pools: STEP when configured, else ALL (vLLM's tok_pooling_type)."""
        return "STEP" if self.pooling_type == "STEP" else "ALL"

    @property
    def sequence_pooling_type(self) -> str:
        """How a sequence task pools: LAST under ALL / STEP (a decoder's default, as vLLM)."""
        return "LAST" if self.is_token_pooling else self.pooling_type

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "PoolerConfig":
        return PoolerConfig(**json.loads(text))


def is_pooling_architecture(architecture: str) -> bool:
    return architecture.endswith(("ForSequenceClassification", "Model"))


def _parse_json(pooler_json: str) -> dict[str, Any]:
    if not pooler_json:
        return {}
    try:
        raw = json.loads(pooler_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--pooler-config: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--pooler-config: must be a JSON object")
    unknown = sorted(set(raw) - _ACCEPTED_KEYS)
    if unknown:
        raise ValueError(f"--pooler-config: unsupported key(s) {unknown}; supported: {sorted(_ACCEPTED_KEYS)}")
    return raw


def _task(convert: str, architecture: str, raw: dict[str, Any]) -> tuple[str, bool]:
    classifier = architecture.endswith("ForSequenceClassification")
    if convert == "auto":  # NOTE: a resolved config's own JSON resolves to itself ("reward" included)
        task = str(raw.get("task") or "").removeprefix("token_")  # token_embed: embed, pooled per token
        convert = "reward" if raw.get("reward") else task or ("classify" if classifier else "embed")
    if convert not in ("embed", "classify", "reward"):
        raise ValueError(f"--pooler-config task {convert!r}: choose embed, classify, token_embed or token_classify")
    if convert in ("classify", "reward") and not classifier:
        raise ValueError(f"--convert {convert} needs a *ForSequenceClassification checkpoint (its score head); "
                         f"{architecture} has none")
    if convert == "embed" and classifier:
        raise ValueError(f"--convert embed: {architecture} is a classifier; serve it with --convert classify")
    return ("classify" if convert == "reward" else convert), convert == "reward"


def _bool(raw: dict[str, Any], *keys: str) -> bool | None:
    for key in keys:
        value = raw.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise ValueError(f"--pooler-config {key}: must be true or false")
            return value
    return None


def resolve_pooler(runner: str, convert: str, pooler_json: str, model_config) -> tuple[str, PoolerConfig | None]:
    """The resolved runner ("generate" | "pooling") and, for pooling, its PoolerConfig; ValueError naming the flag."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner {runner!r}: choose from {', '.join(RUNNERS)}")
    if convert not in CONVERTS:
        raise ValueError(f"--convert {convert!r}: choose from {', '.join(CONVERTS)}")
    architecture = model_config.architecture
    if runner == "auto":
        runner = "pooling" if is_pooling_architecture(architecture) else "generate"
    if runner == "generate":
        if is_pooling_architecture(architecture):
            raise ValueError(f"{architecture} has no LM head: serve it with --runner pooling")
        if convert != "auto" or pooler_json:
            raise ValueError("--convert and --pooler-config need --runner pooling")
        return "generate", None
    if pooling_base(architecture) not in POOLING_BASES:
        raise ValueError(f"--runner pooling: {architecture} is not supported; pooling heads sit on "
                         f"{', '.join(POOLING_BASES)} backbones")
    raw = _parse_json(pooler_json)
    task, reward = _task(convert, architecture, raw)
    token_task = str(raw.get("task") or "").startswith("token_")
    pooling_type = raw.get("pooling_type") or raw.get("seq_pooling_type") or ("ALL" if token_task else "LAST")
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"--pooler-config pooling_type {pooling_type!r}: choose from {', '.join(POOLING_TYPES)}")
    if token_task and pooling_type not in TOKEN_POOLING_TYPES:
        raise ValueError(f"--pooler-config task {raw['task']!r} pools per token: pooling_type ALL or STEP")
    use_activation = _bool(raw, "use_activation", "normalize", "activation", "softmax")
    dimensions = raw.get("dimensions")
    if dimensions is not None:
        if task != "embed" or not isinstance(dimensions, int) or not 0 < dimensions <= model_config.hidden_size:
            raise ValueError(f"--pooler-config dimensions: an embedding size in [1, {model_config.hidden_size}]")
    step_tag_id, returned = _step_fields(raw, pooling_type, model_config)
    return "pooling", PoolerConfig(
        task=task, pooling_type=pooling_type,
        use_activation=(not reward) if use_activation is None else use_activation,
        dimensions=dimensions, reward=reward, step_tag_id=step_tag_id, returned_token_ids=returned,
    )


def _step_fields(raw: dict[str, Any], pooling_type: str, model_config) -> tuple[int | None, tuple[int, ...] | None]:
    """STEP's step_tag_id (a token id) and returned_token_ids (column indices of an output row)."""
    step_tag_id, returned = raw.get("step_tag_id"), raw.get("returned_token_ids")
    if pooling_type != "STEP":
        for key in ("step_tag_id", "returned_token_ids"):
            if raw.get(key) is not None:
                raise ValueError(f"--pooler-config {key}: needs pooling_type STEP")
        return None, None
    if step_tag_id is not None and (isinstance(step_tag_id, bool) or not isinstance(step_tag_id, int)
                                    or not 0 <= step_tag_id < model_config.vocab_size):
        raise ValueError(f"--pooler-config step_tag_id: a token id in [0, {model_config.vocab_size})")
    if returned is not None:
        width = model_config.num_labels or model_config.hidden_size
        if (not isinstance(returned, list) or not returned
                or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < width for i in returned)):
            raise ValueError(f"--pooler-config returned_token_ids: a non-empty list of column indices in [0, {width})")
        returned = tuple(returned)
    return step_tag_id, returned
