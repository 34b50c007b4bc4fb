"""LoRA adapters at run time: vLLM's and SGLang's routes.

    POST /v1/load_lora_adapter   {"lora_name", "lora_path", "load_inplace": false}   (vLLM)
        400 LoRA off, or an adapter the engine cannot serve (malformed, rank over
            --max-lora-rank, target modules the model lacks); 403 path outside
            --allowed-lora-paths; 409 the name is taken (unless load_inplace).
        load_inplace: true with a name in use replaces that adapter between two
            steps: it is loaded under a new engine id while the old one serves,
            then requests admitted from then on get the new one; requests in
            flight finish on the old one (a request never mixes two adapters,
            and the prefix cache is keyed by engine id, so no KV computed with
            the old adapter is reused), which is unloaded once they are done.
    POST /v1/unload_lora_adapter {"lora_name", "mode": "wait" | "abort", "timeout_s"}
        404 unknown name. New requests for the adapter get 404 at once; with
        "wait" the ones in flight finish first (bounded by timeout_s: then 409
        and the adapter is served again), with "abort" they end now
        (finish_reason "abort").
    POST /load_lora_adapter   {"lora_name", "lora_path", "pinned": false}   (SGLang)
    POST /unload_lora_adapter {"lora_name"}
        The same operations (unload waits for requests in flight), answered as
        SGLang's LoRAUpdateOutput: {"success": true, "error_message": null,
        "loaded_adapters": {name: path}}. pinned: true is a 400 (Trillium has
        no pinned slots).

With `--admin-on-data-port` these routes are on the data port too, where vLLM
clients call /v1/load_lora_adapter.
"""

from __future__ import annotations

import logging
import os

import trio
from quart import Blueprint, current_app, request

from trillium.actors.protocol.admin import LoadLoRAAdapter, UnloadLoRAAdapter
from trillium.control_plane.errors import AdminError, bad_request, conflict, forbidden
from trillium.control_plane.protocol import (
    LoadLoRARequest,
    SGLangLoadLoRARequest,
    SGLangUnloadLoRARequest,
    UnloadLoRARequest,
    parse_body,
)
from trillium.control_plane.responses import json_response, success
from trillium.control_plane.state import AdminState, new_command_id

log = logging.getLogger(__name__)

_POLL_S = 0.02
_RETIRE_RETRY_S = 1.0


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("lora", __name__)
    engine = state.engine
    client = engine.client

    def registry():
        if engine.loras is None:
            raise bad_request("LoRA is not enabled: start the server with --enable-lora")
        return engine.loras

    def checked_path(lora_path: str) -> str:
        if not engine.lora_paths.is_allowed(lora_path):
            raise forbidden(f"lora_path {lora_path!r} is outside the allowed roots (--allowed-lora-paths)",
                            "lora_path")
        path = engine.lora_paths.resolve(lora_path)
        if not os.path.isdir(path):
            raise bad_request(f"lora_path {lora_path!r} is not a directory", "lora_path")
        escaping = engine.lora_paths.escaping_links(path)  # an adapter directory: a few files
        if escaping:
            raise forbidden(f"lora_path {lora_path!r} holds links out of the allowed roots: "
                            f"{', '.join(escaping[:8])}", "lora_path")
        return path

    async def load(name: str, lora_path: str, replace: bool):
        loras, path = registry(), checked_path(lora_path)
        if replace and loras.get(name) is not None:
            return await load_replacement(loras, name, path)
        try:
            module = loras.reserve(name, path)
        except KeyError:
            raise conflict(f"a LoRA adapter named {name!r} is already loaded") from None
        try:
            reply = await state.run(LoadLoRAAdapter(new_command_id(), module.lora_id, module.name, path))
        except BaseException:
            loras.remove(module.name)
            raise
        loras.added(module.name)
        return reply

    async def load_replacement(loras, name: str, path: str):
        try:
            module = loras.reserve_replacement(name, path)
        except (KeyError, ValueError):
            raise conflict(f"LoRA adapter {name!r} is being unloaded or replaced already") from None
        try:
            reply = await state.run(LoadLoRAAdapter(new_command_id(), module.lora_id, name, path))
        except BaseException:
            loras.drop_replacement(name)
            raise
        old = loras.replaced(name)
        current_app.add_background_task(retire, old)
        return reply

    async def retire(old) -> None:
        """Unload a replaced adapter once no request uses it any more."""
        while True:
            while client.requests_using_lora(old.lora_id):
                await trio.sleep(_POLL_S)
            reply = await state.command(UnloadLoRAAdapter(new_command_id(), old.lora_id))
            if reply.status != 409:
                break
            # WHY retry: a request that looked the name up just before the swap may still
            # reach the engine with the old id, or the engine is asleep / paused for now.
            await trio.sleep(_RETIRE_RETRY_S)
        if not reply.ok:
            log.warning("replaced LoRA adapter %r (id %d) was not unloaded: %s", old.name, old.lora_id,
                        reply.message)

    async def unload(name: str, mode: str, timeout_s: float):
        loras = registry()
        if loras.is_replacing(name):
            raise conflict(f"LoRA adapter {name!r} is being replaced; unload it once that is done")
        try:
            module = loras.begin_unload(name)
        except KeyError:
            raise AdminError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                             code="not_found") from None
        try:
            if mode == "abort" and client.requests_using_lora(module.lora_id):
                await client.abort(client.requests_using_lora(module.lora_id))
            with trio.move_on_after(timeout_s):
                while client.requests_using_lora(module.lora_id):
                    await trio.sleep(_POLL_S)
            if client.requests_using_lora(module.lora_id):
                raise conflict(f"requests still use LoRA adapter {module.name!r} after {timeout_s:g} s; "
                               "it stays loaded (unload with mode \"abort\" to end them)")
            reply = await state.run(UnloadLoRAAdapter(new_command_id(), module.lora_id))
        except BaseException:
            loras.restore(module.name)
            raise
        loras.unloaded(module.name)
        return reply

    def sglang_output() -> dict:
        return {"success": True, "error_message": None,
                "loaded_adapters": {m.name: m.path for m in registry().served()}}

    @bp.post("/v1/load_lora_adapter")
    async def load_lora_adapter():
        body = parse_body(LoadLoRARequest, await request.get_data())
        reply = await load(body.lora_name, body.lora_path, body.load_inplace)
        return success(reply, f"LoRA adapter {body.lora_name!r} loaded", lora_name=body.lora_name)

    @bp.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter():
        body = parse_body(UnloadLoRARequest, await request.get_data())
        reply = await unload(body.lora_name, body.mode, body.timeout_s)
        return success(reply, f"LoRA adapter {body.lora_name!r} unloaded", lora_name=body.lora_name)

    @bp.post("/load_lora_adapter")
    async def sglang_load_lora_adapter():
        body = parse_body(SGLangLoadLoRARequest, await request.get_data())
        if body.pinned:
            raise bad_request("pinned: Trillium has no pinned LoRA slots (adapters share --max-loras)", "pinned")
        if body.lora_id is not None:
            raise bad_request("lora_id: the server assigns adapter ids; leave it out", "lora_id")
        await load(body.lora_name, body.lora_path, False)
        return json_response(sglang_output())

    @bp.post("/unload_lora_adapter")
    async def sglang_unload_lora_adapter():
        body = parse_body(SGLangUnloadLoRARequest, await request.get_data())
        if body.lora_id is not None:
            raise bad_request("lora_id: the server assigns adapter ids; name the adapter by lora_name", "lora_id")
        await unload(body.lora_name, "wait", UnloadLoRARequest.model_fields["timeout_s"].default)
        return json_response(sglang_output())

    return bp
