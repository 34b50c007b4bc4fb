"""Server-sent events for streamed responses, OpenAI's framing.

    data: {json}\n\n   ...   data: [DONE]\n\n

`sse_response(body)` wraps an async iterator of encoded events in a Quart
response with no send timeout (a long generation is not a stuck client).
An error after the headers went out (a rejected request, an unexpected
exception, logged; the engine failing mid-stream, a 503 naming why)
travels as one `data: {"error": ...}` event, which the openai SDK raises
as APIError.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator

from quart import Response

from trillium.actors.client import EngineFailed
from trillium.data_plane.errors import ApiError, engine_failed, internal_error

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def event(obj) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


class ChunkEvents:
    """`event({**header, "choices": [choice], **extra})` for a stream's chunks,
    byte for byte, with the constant header encoded once (every streamed
    token pays for the rest)."""

    def __init__(self, header: dict, extra: dict) -> None:
        self._prefix = b"data: " + dumps(header)[:-1].encode() + b',"choices":['
        tail = "," + dumps(extra)[1:-1] if extra else ""  # e.g. ,"usage":null
        self._suffix = b"]" + tail.encode() + b"}\n\n"

    def __call__(self, choice: dict) -> bytes:
        return self._prefix + dumps(choice).encode() + self._suffix


def error_event(error: ApiError) -> bytes:
    return event(error.body())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: prompt tokens served
    from the prefix cache (vLLM's with --enable-prompt-tokens-details; always here)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


async def _guarded(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass events through; an unexpected error becomes an error event and [DONE]."""
    # WHY aclosing: when the client leaves, closing this generator must close
    # `body` at once, so its `finally` (the engine abort) runs now, not at GC.
    async with contextlib.aclosing(body) as events:
        try:
            async for item in events:
                yield item
        except EngineFailed as exc:
            yield error_event(engine_failed(str(exc)))
            yield DONE
        except Exception:
            log.exception("error while streaming a response")
            yield error_event(internal_error())
            yield DONE


def sse_response(body: AsyncIterator[bytes]) -> Response:
    response = Response(_guarded(body), status=200, mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # WHY: proxies must not buffer a token stream
    response.timeout = None
    return response


def json_response(obj, status: int = 200) -> Response:
    return Response(dumps(obj), status=status, mimetype="application/json")
