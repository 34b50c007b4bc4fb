"""Pydantic models of the admin request bodies (SGLang / vLLM field names).

Trillium's own bodies use strict types (a string is not a number, `1` is
not `true`); the lifecycle words parse straight to their enums (PauseMode,
WakeTag: a bad value is a 400 listing the choices, as a Literal gives);
unknown fields are ignored and logged, so a client written for SGLang (which
sends extras such as `load_format`) keeps working. An empty body means `{}`.

Bodies of SGLang's routes (`_LaxBody`: the weight updates and groups Trillium
shares with SGLang; `_SGLangBody`: the routes only SGLang names) are
validated in pydantic's lax mode, as SGLang's own models are: AReaL sends
`"master_port": "29500"`, which SGLang accepts. `_SGLangBody` lists every
field of SGLang's struct (sglang/srt/managers/io_struct.py) and refuses any
other with a 400; a field Trillium does not implement is a 400 naming it
when set to anything but SGLang's default.
`parse_body(model, raw)` turns malformed JSON or a validation error into a
400 naming the field.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from trillium.actors.protocol.vocabulary import PauseMode, WakeTag
from trillium.control_plane.errors import bad_request

log = logging.getLogger(__name__)

ActorName = Literal["executor", "scheduler", "detokenizer"]
Version = Annotated[str, Field(min_length=1, max_length=256)]
Port = Annotated[int, Field(ge=1, le=65535)]
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
          "float8_e4m3fn", "float8_e5m2")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class _LaxBody(_Body):
    model_config = ConfigDict(strict=False, extra="allow", allow_inf_nan=False)


class _SGLangBody(_Body):
    model_config = ConfigDict(strict=False, extra="forbid", allow_inf_nan=False)


class SleepRequest(_Body):
    level: Annotated[int, Field(ge=1, le=2)] = 1  # WHY not Literal: lax mode turns "2" into 2 only for an int
    mode: PauseMode = PauseMode.ABORT


class WakeUpRequest(_Body):
    tags: list[WakeTag] | None = None


class PauseRequest(_Body):
    mode: PauseMode = PauseMode.ABORT
    # vLLM's query-only arguments of /pause (vllm/entrypoints/serve/dev/rlhf/api_router.py)
    wait_for_inflight_requests: bool | None = None  # true: mode "wait" (vLLM's deprecated spelling)
    clear_cache: bool | None = None  # true: reset the prefix cache once paused (not with "keep")


class ResetPrefixCacheRequest(_Body):
    # vLLM's query arguments (vllm/entrypoints/serve/cache/api_router.py)
    reset_running_requests: bool = False
    reset_external: bool | None = None


class PauseGenerationRequest(_SGLangBody):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryOccupationRequest(_SGLangBody):
    # SGLang's GPU memory tags (sglang/srt/constants.py); Trillium has no CUDA graphs
    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class AbortRequestRequest(_SGLangBody):
    rid: str = ""
    abort_all: bool = False


class UpdateWeightVersionRequest(_SGLangBody):
    new_version: Version
    abort_all_requests: bool = True  # SGLang's default


class FlushCacheRequest(_SGLangBody):
    timeout: Annotated[float, Field(ge=0)] = 0.0  # SGLang's query argument: Trillium's flush never waits


class SGLangLoadLoRARequest(_SGLangBody):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1)]
    pinned: bool = False
    lora_id: str | None = None  # SGLang's tokenizer manager fills it in; a client never does


class SGLangUnloadLoRARequest(_SGLangBody):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_id: str | None = None


class _UpdateBody(_LaxBody):
    weight_version: Version | None = None
    flush_cache: bool = True
    # SGLang's name: abort requests in flight instead of letting them finish first.
    abort_all_requests: bool = False
    # Speculative decoding (speculative/draft_weights.py): true updates the draft (draft model or
    # EAGLE head) instead of the target. SGLang's disable_draft_model: true is what a target
    # update always is here (the draft is its own checkpoint); false asks for the same tensors in
    # both, which Trillium does not do (400, check_draft_routing).
    draft_model_only: bool = False
    disable_draft_model: bool | None = None

    @pydantic.model_validator(mode="after")
    def _draft_routing(self) -> "_UpdateBody":
        check_draft_routing(self.draft_model_only, self.disable_draft_model)
        return self


def check_draft_routing(draft_model_only: bool, disable_draft_model: bool | None) -> None:
    """ValueError for the routings Trillium does not implement (see _UpdateBody)."""
    if draft_model_only and disable_draft_model:
        raise ValueError("draft_model_only and disable_draft_model are mutually exclusive")
    if disable_draft_model is False:
        raise ValueError("disable_draft_model: false (one update of both target and draft) is not implemented: "
                         "the draft is its own checkpoint; update it separately with draft_model_only: true")


class UpdateFromDiskRequest(_UpdateBody):
    model_path: Annotated[str, Field(min_length=1)]


class InitGroupRequest(_LaxBody):
    master_address: Annotated[str, Field(min_length=1)]
    master_port: Port
    rank_offset: Annotated[int, Field(ge=1)] = 1
    world_size: Annotated[int, Field(ge=2)] = 2
    group_name: Annotated[str, Field(min_length=1)] = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0

    @pydantic.model_validator(mode="after")
    def _rank_in_group(self) -> "InitGroupRequest":
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be < world_size {self.world_size}")
        return self


MAX_DIMENSION = 2**31 - 1  # far above any real weight dimension (vocabularies are ~2**18)


class UpdateFromDistributedRequest(_UpdateBody):
    names: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    dtypes: list[str]
    # WHY bounded here: a dimension past int64 cannot even cross to the engine (it was a 500); the
    # engine checks the rest (names, shapes, total size) against the model before allocating.
    shapes: list[Annotated[list[Annotated[int, Field(ge=0, le=MAX_DIMENSION)]], Field(max_length=8)]]
    group_name: Annotated[str, Field(min_length=1)] | None = None  # SGLang's: must be the open group

    @field_validator("dtypes")
    @classmethod
    def _known_dtypes(cls, dtypes: list[str]) -> list[str]:
        names = [d.removeprefix("torch.") for d in dtypes]
        unknown = sorted({d for d in names if d not in DTYPES})
        if unknown:
            raise ValueError(f"unknown dtype(s) {unknown}; expected torch dtype names such as float32, bfloat16")
        return names

    @pydantic.model_validator(mode="after")
    def _same_lengths(self) -> "UpdateFromDistributedRequest":
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have the same length "
                f"({len(self.names)}, {len(self.dtypes)}, {len(self.shapes)})"
            )
        if len(set(self.names)) != len(self.names):
            raise ValueError("names must be unique")
        return self


class LoadLoRARequest(_Body):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1)]
    # vLLM's: a name in use gets the new adapter (vllm/entrypoints/serve/lora/protocol.py)
    load_inplace: bool = False


class UnloadLoRARequest(_Body):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    # wait: requests using it finish first (new ones already get 404); abort: they end now.
    mode: Literal["wait", "abort"] = "wait"
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300.0


class StartProfileRequest(_Body):
    actors: Annotated[list[ActorName], Field(min_length=1)] | None = None
    record_shapes: bool = False
    with_stack: bool = False
    max_duration_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 300.0
    timeline: bool = False  # spans only (no cProfile / torch.profiler): bench/step_timeline.py


class AbortRequestsRequest(_Body):
    request_ids: list[Annotated[str, Field(min_length=1)]] | None = None


class EmptyRequest(_Body):
    pass


class DestroyGroupRequest(_Body):
    group_name: Annotated[str, Field(min_length=1)] | None = None  # SGLang's: must be the open group


def parse_body(model: type[_Body], raw: bytes) -> Any:
    """Validate a JSON body (empty means {}); AdminError(400) naming the first bad field."""
    try:
        parsed = model.model_validate_json(raw if raw.strip() else b"{}")
    except pydantic.ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise bad_request(f"malformed JSON body: {first['msg']}") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise bad_request("the request body must be a JSON object") from None
        param = ".".join(str(part) for part in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field: SGLang's body for this route has no such field"
        raise bad_request(f"{param}: {message}" if param else message, param) from None
    if parsed.model_extra:
        log.info("%s: ignoring unknown fields %s", model.__name__, sorted(parsed.model_extra))
    return parsed


def parse_bool(value: str | None, name: str, default: bool) -> bool:
    """A query-string flag: true/false/1/0/yes/no."""
    if value is None or value == "":
        return default
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise bad_request(f"{name}: expected true or false, got {value!r}", name)
