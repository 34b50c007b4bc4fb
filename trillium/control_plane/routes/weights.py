"""Weight updates from disk and from an uploaded safetensors file; GET /weight_version.

    POST /update_weights_from_disk {"model_path", "weight_version"?, "flush_cache": true,
                                    "abort_all_requests": false}
        model_path is resolved (symlinks, ..) and must lie under an allowed
        root (--allowed-weight-paths), else 403, as must every link inside
        it (paths.py `escaping_links`); a missing path is 400.
    POST /update_weights_from_tensor?weight_version=...&flush_cache=true&abort_all_requests=false
        body: the raw bytes of a safetensors file (HF parameter names). It
        is streamed to a private temp file under the body size cap (413
        beyond; uploads.py), its header checked with the `safetensors`
        library (no pickle) before anything reaches the engine (a malformed
        file is 400), and the executor reads the file once; it is deleted
        when the update is answered.
        Names and shapes are the engine's to check (400, old weights kept).
        SGLang's JSON body ({"serialized_named_tensors": [...]}, tensors pickled
        by its MultiprocessingSerializer) is a 400 saying why and what to send
        instead: Trillium never unpickles request data.
    GET /weight_version, GET /get_weight_version (SGLang) -> {"weight_version": str}
    POST /update_weight_version {"new_version", "abort_all_requests": true}   (SGLang)
        Renames the weights being served (weights and caches unchanged); every
        plane reports the new name. -> {"success", "message", "new_version"}

Each update runs through `AdminState.update_weights` (admission closed,
requests in flight drained, one update at a time) and answers
`{"success": true, "message", "weight_version"}`.

`draft_model_only` (disk body, tensor query) updates the speculative draft
instead (draft model or EAGLE head; a 400 on a server without one): the same
path and tensor checks, the draft's own `draft_weight_version` in the answer.
SGLang's `disable_draft_model`: true is a plain target update; false (target
and draft from one payload) is a 400 naming it (protocol.check_draft_routing).
"""

from __future__ import annotations

import json
import os

import numpy as np
import trio
from quart import Blueprint, request

from trillium.actors.protocol.admin import (
    AbortRequests,
    ControlReply,
    SetWeightVersion,
    UpdateWeightsFromDisk,
    UpdateWeightsFromTensors,
)
from trillium.control_plane.errors import bad_request, forbidden
from trillium.control_plane.protocol import (
    UpdateFromDiskRequest,
    UpdateWeightVersionRequest,
    check_draft_routing,
    parse_body,
    parse_bool,
)
from trillium.control_plane.query import takes_query
from trillium.control_plane.responses import json_response, success
from trillium.control_plane.state import AdminState, new_command_id
from trillium.control_plane.uploads import HEAD_BYTES, check_safetensors_file, streamed_upload

MAX_VERSION_CHARS = 256


def check_safetensors(data: bytes) -> tuple[int, int]:
    """(number of tensors, bytes of tensor data); ValueError when `data` is not a safetensors file."""
    import safetensors

    try:
        tensors = safetensors.deserialize(data)
    except Exception as exc:  # WHY: the Rust parser raises its own SafetensorError for every defect
        raise ValueError(f"not a valid safetensors file: {exc}") from None
    if not tensors:
        raise ValueError("the safetensors file holds no tensors")
    return len(tensors), sum(len(info["data"]) for _, info in tensors)


_NO_PICKLE = (
    "this looks like SGLang's update_weights_from_tensor body: its serialized_named_tensors are pickled "
    "Python objects, and Trillium never unpickles request data. Send the tensors as the raw bytes of a "
    "safetensors file instead (Content-Type: application/octet-stream; weight_version, flush_cache and "
    "abort_all_requests go in the query string; trillium.rlhf.WeightSync.push_tensors does this), or broadcast them "
    "with /init_weights_update_group + /update_weights_from_distributed"
)


def refuse_json_payload(content_type: str, body: bytes) -> None:
    """400 for a JSON body (SGLang's pickled payload or any other): only safetensors bytes are accepted."""
    if content_type.split(";")[0].strip().lower() != "application/json" and body[:1] != b"{":
        return
    try:  # WHY parse: a safetensors file can start with "{" (a header 123 bytes long); it is never JSON
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        if content_type.startswith("application/json"):
            raise bad_request("the body must be a safetensors file, not JSON") from None
        return
    if isinstance(payload, dict) and "serialized_named_tensors" in payload:
        raise bad_request(_NO_PICKLE, "serialized_named_tensors")
    raise bad_request("the body must be a safetensors file, not JSON (see POST /update_weights_from_tensor "
                      "in the README)")


async def load_from_disk(
    state: AdminState, model_path: str, *, weight_version: str | None = None, flush_cache: bool = True,
    abort_all_requests: bool = False, param: str = "model_path", draft_model_only: bool = False,
) -> tuple[ControlReply, str]:
    """One disk update as every route that loads a checkpoint directory runs it (SGLang's, AReaL's,
    prime-rl's): the allowed-paths check (403), the path must exist (400), no link in it may
    lead out of the allowed roots (403), then
    `AdminState.update_weights`. Returns the engine's reply and the resolved path."""
    if draft_model_only:
        check_has_draft(state)
    policy = state.engine.weight_paths
    if not policy.is_allowed(model_path):
        allowed = ", ".join(policy.roots) or "none (start with --allowed-weight-paths)"
        raise forbidden(f"{param} {model_path!r} is outside the allowed weight paths ({allowed})", param)
    path = policy.resolve(model_path)
    if not await trio.to_thread.run_sync(os.path.exists, path):
        raise bad_request(f"{param} {model_path!r} does not exist", param)
    escaping = await trio.to_thread.run_sync(policy.escaping_links, path)
    if escaping:
        raise forbidden(f"{param} {model_path!r} holds links out of the allowed weight paths: "
                        f"{', '.join(escaping[:8])}", param)
    command = UpdateWeightsFromDisk(new_command_id(), model_path=path, weight_version=weight_version,
                                    flush_cache=flush_cache, draft_model_only=draft_model_only)
    reply = await state.update_weights(command, source="disk", abort_all_requests=abort_all_requests)
    return reply, path


def check_has_draft(state: AdminState) -> None:
    """400 for draft_model_only on a server whose proposer has no weights (ngram, or none)."""
    method = state.engine.engine_config.speculative_config.method
    if method not in ("draft_model", "eagle"):
        what = f"--speculative-config method {method!r}" if method else "no --speculative-config"
        raise bad_request(f"draft_model_only: this server has no draft model to update ({what}); only the "
                          "draft_model and eagle methods have draft weights", "draft_model_only")


def _updated(reply: ControlReply, draft_model_only: bool, message: str, state: AdminState):
    """The success body; a draft update names its own version (the target's is unchanged)."""
    extra = {"draft_weight_version": reply.data.get("draft_weight_version")} if draft_model_only else {}
    return success(reply, message, weight_version=state.status.weight_version, **extra)


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("weights", __name__)

    @bp.post("/update_weights_from_disk")
    async def update_from_disk():
        req = parse_body(UpdateFromDiskRequest, await request.get_data())
        reply, path = await load_from_disk(state, req.model_path, weight_version=req.weight_version,
                                           flush_cache=req.flush_cache, abort_all_requests=req.abort_all_requests,
                                           draft_model_only=req.draft_model_only)
        what = "draft weights" if req.draft_model_only else "weights"
        return _updated(reply, req.draft_model_only, f"loaded {what} from {path}", state)

    @bp.post("/update_weights_from_tensor")
    @takes_query("weight_version", "flush_cache", "abort_all_requests", "draft_model_only", "disable_draft_model")
    async def update_from_tensor():
        version = request.args.get("weight_version") or None
        if version is not None and len(version) > MAX_VERSION_CHARS:
            raise bad_request(f"weight_version: at most {MAX_VERSION_CHARS} characters", "weight_version")
        flush_cache = parse_bool(request.args.get("flush_cache"), "flush_cache", True)
        abort_all = parse_bool(request.args.get("abort_all_requests"), "abort_all_requests", False)
        draft_only = parse_bool(request.args.get("draft_model_only"), "draft_model_only", False)
        disable_draft = request.args.get("disable_draft_model")
        try:
            check_draft_routing(draft_only, None if disable_draft in (None, "") else
                                parse_bool(disable_draft, "disable_draft_model", True))
        except ValueError as exc:
            raise bad_request(str(exc), "disable_draft_model") from None
        if draft_only:
            check_has_draft(state)
        async with streamed_upload(request.body, state.engine.max_body_bytes) as upload:
            if not upload.num_bytes:
                raise bad_request("the body must be a safetensors file (got an empty body)")
            content_type = request.headers.get("Content-Type", "")
            if upload.num_bytes <= HEAD_BYTES:  # WHY only then: a JSON body is small; a large one is a file
                refuse_json_payload(content_type, upload.head)
            elif content_type.split(";")[0].strip().lower() == "application/json":
                raise bad_request("the body must be a safetensors file, not JSON")
            try:
                num_tensors, num_bytes = await trio.to_thread.run_sync(check_safetensors_file, upload.path)
            except ValueError as exc:
                raise bad_request(str(exc)) from None
            command = UpdateWeightsFromTensors(new_command_id(), safetensors=np.zeros(0, dtype=np.uint8),
                                               weight_version=version, flush_cache=flush_cache,
                                               safetensors_path=upload.path, draft_model_only=draft_only)
            reply = await state.update_weights(command, source="tensor", abort_all_requests=abort_all)
        return _updated(reply, draft_only, f"loaded {num_tensors} tensors ({num_bytes} bytes)", state)

    @bp.get("/weight_version")
    @bp.get("/get_weight_version")
    async def weight_version():
        return json_response({"weight_version": state.status.weight_version})

    @bp.post("/update_weight_version")
    async def update_weight_version():
        req = parse_body(UpdateWeightVersionRequest, await request.get_data())
        async with state.exclusive:  # WHY: not in the middle of a weight update, which sets its own version
            if req.abort_all_requests:
                await state.run(AbortRequests(new_command_id()))
            await state.run(SetWeightVersion(new_command_id(), req.new_version), weight_version=req.new_version)
        return json_response({"success": True, "message": f"Weight version updated to {req.new_version}",
                              "new_version": req.new_version, "weight_version": state.status.weight_version})

    return bp
