"""GET / POST /tracing: OpenTelemetry tracing on, off and re-sampled at run time.

    GET  /tracing  -> {"enabled", "sample_ratio", "detailed", "otlp_traces_endpoint"}
    POST /tracing {"enabled"?: bool, "sample_ratio"?: 0..1, "detailed"?: bool}
                   -> {"success": true, "message", ...the new settings}

Only the api process changes: it decides per request whether to trace
(`RequestTracing.sample`), and only sampled requests carry a trace context
into the engine, so the actors need no command. 400 for a bad value; 409
to enable tracing on a server started without --otlp-traces-endpoint.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint, request

from trillium.control_plane.errors import AdminError
from trillium.control_plane.protocol import parse_body
from trillium.control_plane.responses import json_response
from trillium.control_plane.state import AdminState
from trillium.observability.tracing import RequestTracing, TracingNotConfigured

_OFF = {"enabled": False, "sample_ratio": 1.0, "detailed": False, "otlp_traces_endpoint": None}


class TracingRequest(BaseModel):
    # The same strictness as control_plane/protocol.py's bodies.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    enabled: bool | None = None
    sample_ratio: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    detailed: bool | None = None


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("tracing", __name__)
    tracing: RequestTracing | None = state.engine.tracing

    @bp.get("/tracing")
    async def get_tracing():
        return json_response(tracing.settings() if tracing is not None else _OFF)

    @bp.post("/tracing")
    async def set_tracing():
        req = parse_body(TracingRequest, await request.get_data())
        if tracing is None:
            if req.enabled:
                raise _not_configured("this server has no tracing: start it with --otlp-traces-endpoint")
            return json_response({**_OFF, "success": True, "message": "tracing is off"})
        try:
            settings = tracing.update(enabled=req.enabled, sample_ratio=req.sample_ratio, detailed=req.detailed)
        except TracingNotConfigured as exc:
            raise _not_configured(str(exc)) from None
        message = f"tracing {'on' if settings['enabled'] else 'off'}"
        if settings["enabled"]:
            message += f", sample ratio {settings['sample_ratio']:g}{', detailed' if settings['detailed'] else ''}"
        return json_response({**settings, "success": True, "message": message})

    return bp


def _not_configured(message: str) -> AdminError:
    return AdminError(409, message, code="tracing_not_configured")
