"""The responses /v1/responses keeps: a bounded, in-memory, least-recently-used store.

One `ResponseStore` per data-plane app (routes/responses.py builds it), sized
by `--responses-store-size` (DataPlaneEngine.responses_store_size; 0 keeps
nothing). A stored response is what GET /v1/responses/{id} returns and what
`previous_response_id` continues:

    response    the Response object as last reported (a background one is
                updated in place as it runs)
    messages    the chat messages it answered, without its `instructions`
                (OpenAI: instructions do not carry over to a chained response)
    cancel      a background response's run while it runs (None otherwise):
                POST /v1/responses/{id}/cancel cancels it

INVARIANT: at most `max_responses` entries. Storing one more evicts the
least recently stored or read one (its id is a 404 from then on); an evicted
background response that is still running is cancelled, since nobody can
read its result any more. Each entry holds one conversation's text, so the
memory it takes is bounded by the size times the context length.

State lives in the app's trio thread only (no locks: every route runs there).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs
import trio

DEFAULT_RESPONSES_STORE_SIZE = 1000


@attrs.define
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]
    cancel: trio.CancelScope | None = None

    @property
    def running(self) -> bool:
        return self.response["status"] in ("queued", "in_progress")


class ResponseStore:
    def __init__(self, max_responses: int) -> None:
        if max_responses < 0:
            raise ValueError(f"--responses-store-size: must be >= 0, got {max_responses}")
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_responses:
            _, evicted = self._entries.popitem(last=False)
            if evicted.cancel is not None:
                evicted.cancel.cancel()

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None and entry.cancel is not None:
            entry.cancel.cancel()
        return entry is not None


__all__ = ["DEFAULT_RESPONSES_STORE_SIZE", "ResponseStore", "StoredResponse"]
