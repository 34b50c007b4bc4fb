"""POST /start_profile and POST /stop_profile: torch.profiler traces per actor.

    /start_profile {"actors"?: ["executor", "scheduler", "detokenizer"],
                    "record_shapes": false, "with_stack": false, "max_duration_s": 300,
                    "timeline": false}
    /stop_profile  -> {"success": true, "files": [paths], "profile_dir": str}

Traces go to --profile-dir (files per actor). A profile that is not stopped
ends by itself after max_duration_s (its files are written then).
"timeline": true records spans only (each actor's `.trace.json`, the
executor's step stages among them) without cProfile or torch.profiler, so
the engine runs at its normal speed: what bench/step_timeline.py reads. Starting
while one runs, or stopping when none runs, is the engine's 409.
"""

from __future__ import annotations

import os
import time

import trio
from quart import Blueprint, request

from trillium.actors.protocol.admin import StartProfile, StopProfile
from trillium.control_plane.errors import AdminError
from trillium.control_plane.protocol import (
    EmptyRequest,
    StartProfileRequest,
    parse_body,
)
from trillium.control_plane.responses import success
from trillium.control_plane.state import AdminState, new_command_id

ALL_ACTORS = ("executor", "scheduler", "detokenizer")


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("profiling", __name__)
    profile_dir = state.engine.profile_dir

    @bp.post("/start_profile")
    async def start_profile():
        req = parse_body(StartProfileRequest, await request.get_data())
        if not profile_dir:
            raise AdminError(500, "no profile directory configured (--profile-dir)")
        await trio.to_thread.run_sync(lambda: os.makedirs(profile_dir, exist_ok=True))
        actors = tuple(dict.fromkeys(req.actors)) if req.actors else ALL_ACTORS
        command = StartProfile(new_command_id(), profile_dir=profile_dir, actors=actors,
                               record_shapes=req.record_shapes, with_stack=req.with_stack,
                               max_duration_s=req.max_duration_s, timeline=req.timeline)
        reply = await state.run(command)
        state.profiling_until_s = time.monotonic() + req.max_duration_s
        return success(reply, f"profiling {', '.join(actors)}", actors=list(actors), profile_dir=profile_dir)

    @bp.post("/stop_profile")
    async def stop_profile():
        parse_body(EmptyRequest, await request.get_data())
        try:
            reply = await state.run(StopProfile(new_command_id()))
        finally:
            state.profiling_until_s = 0.0
        files = [str(f) for f in reply.data.get("files", [])]
        return success(reply, f"wrote {len(files)} trace files", files=files, profile_dir=profile_dir)

    return bp
