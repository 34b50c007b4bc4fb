"""LoRA adapters at run time (vLLM's routes, on the admin port).

    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}
        400 LoRA off, or an adapter the engine cannot serve (malformed, rank over
            --max-lora-rank, target modules the model lacks); 403 path outside
            --allowed-lora-paths; 409 the name is taken.
    POST /v1/unload_lora_adapter {"lora_name", "mode": "wait" | "abort", "timeout_s"}
        404 unknown name. New requests for the adapter get 404 at once; with
        "wait" the ones in flight finish first (bounded by timeout_s: then 409
        and the adapter is served again), with "abort" they end now
        (finish_reason "abort").

Loading runs between two engine steps: streams in flight go on undisturbed.
"""

from __future__ import annotations

import os

import trio
from quart import Blueprint, request

from trillium.actors.protocol.admin import LoadLoRAAdapter, UnloadLoRAAdapter
from trillium.control_plane.errors import AdminError, bad_request, conflict, forbidden
from trillium.control_plane.protocol import LoadLoRARequest, UnloadLoRARequest, parse_body
from trillium.control_plane.responses import success
from trillium.control_plane.state import AdminState, new_command_id

_POLL_S = 0.02


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("lora", __name__)
    engine = state.engine

    def registry():
        if engine.loras is None:
            raise bad_request("LoRA is not enabled: start the server with --enable-lora")
        return engine.loras

    @bp.post("/v1/load_lora_adapter")
    async def load_lora_adapter():
        body = parse_body(LoadLoRARequest, await request.get_data())
        loras = registry()
        if not engine.lora_paths.is_allowed(body.lora_path):
            raise forbidden(f"lora_path {body.lora_path!r} is outside the allowed roots (--allowed-lora-paths)",
                            "lora_path")
        path = engine.lora_paths.resolve(body.lora_path)
        if not os.path.isdir(path):
            raise bad_request(f"lora_path {body.lora_path!r} is not a directory", "lora_path")
        try:
            module = loras.reserve(body.lora_name, path)
        except KeyError:
            raise conflict(f"a LoRA adapter named {body.lora_name!r} is already loaded") from None
        try:
            reply = await state.run(LoadLoRAAdapter(new_command_id(), module.lora_id, module.name, path))
        except BaseException:
            loras.remove(module.name)
            raise
        loras.added(module.name)
        return success(reply, f"LoRA adapter {module.name!r} loaded", lora_name=module.name)

    @bp.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter():
        body = parse_body(UnloadLoRARequest, await request.get_data())
        loras = registry()
        try:
            module = loras.begin_unload(body.lora_name)
        except KeyError:
            raise AdminError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name",
                             code="not_found") from None
        client = engine.client
        try:
            if body.mode == "abort" and client.requests_using_lora(module.lora_id):
                await client.abort(client.requests_using_lora(module.lora_id))
            with trio.move_on_after(body.timeout_s):
                while client.requests_using_lora(module.lora_id):
                    await trio.sleep(_POLL_S)
            if client.requests_using_lora(module.lora_id):
                raise conflict(f"requests still use LoRA adapter {module.name!r} after {body.timeout_s:g} s; "
                               "it stays loaded (unload with mode \"abort\" to end them)")
            reply = await state.run(UnloadLoRAAdapter(new_command_id(), module.lora_id))
        except BaseException:
            loras.restore(module.name)
            raise
        loras.unloaded(module.name)
        return success(reply, f"LoRA adapter {module.name!r} unloaded", lora_name=module.name)

    return bp
