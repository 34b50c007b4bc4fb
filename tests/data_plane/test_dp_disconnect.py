"""A client that goes away mid-request gets its engine requests aborted.

The long request asks for 2000 tokens (one engine step each); after the
disconnect the engine must be idle again within far fewer steps than the
request would have run, i.e. it was aborted, not finished. Progress is
measured in engine steps (SchedulerStats.step_id), never in wall time; the
waits poll with a deadline.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from support.data_plane_server import abort_count, stream_then_leave

LONG_TOKENS = 2000
MAX_STEPS_AFTER_DISCONNECT = 1000


async def _assert_engine_idle_soon(dp_server, http: httpx.AsyncClient, start_step: int) -> None:
    """Probe with 1-token requests (each makes the engine step and report stats)
    until nothing runs; the abort must have landed well before the long request's end."""
    stats = await dp_server.probe_until_idle(http)
    assert stats.step_id - start_step < MAX_STEPS_AFTER_DISCONNECT


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": [5, 6, 7]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
async def test_disconnect_mid_stream_aborts(dp_server, path, body):
    body = {**body, "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=dp_server.url(), timeout=60) as http:
        aborts_before = abort_count((await http.get("/metrics")).text)
        async with httpx.AsyncClient(base_url=dp_server.url(), timeout=60) as doomed:
            await stream_then_leave(doomed, path, body, events=3)
            start_step = dp_server.last_stats.step_id
        # leaving the client closed the connection mid-stream
        await _assert_engine_idle_soon(dp_server, http, start_step)
        assert abort_count((await http.get("/metrics")).text) == aborts_before + 1


async def test_disconnect_mid_non_stream_request_aborts(dp_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG_TOKENS, "ignore_eos": True, "n": 2}
    async with httpx.AsyncClient(base_url=dp_server.url(), timeout=60) as http:
        async with trio.open_nursery() as nursery:
            async def doomed() -> None:
                async with httpx.AsyncClient(base_url=dp_server.url(), timeout=60) as client:
                    await client.post("/v1/chat/completions", json=body)
                raise AssertionError("the request should have been cancelled")

            nursery.start_soon(doomed)
            await dp_server.wait_until(lambda: dp_server.num_in_flight() == 1, "the long request in flight")
            await dp_server.wait_until(
                lambda: dp_server.last_stats is not None and dp_server.last_stats.num_running == 2,
                "two requests running in the engine",
            )
            start_step = dp_server.last_stats.step_id
            nursery.cancel_scope.cancel()  # the client gives up: its connection closes
        await _assert_engine_idle_soon(dp_server, http, start_step)


async def test_disconnect_mid_anthropic_stream_aborts(dp_server):
    """/v1/messages has no ignore_eos: its output_config schema (a string of at least 3000
    characters) keeps the reply going past any EOS instead."""
    schema = {"type": "string", "minLength": 3000}
    body = {"model": "tiny-llama", "max_tokens": LONG_TOKENS, "stream": True,
            "messages": [{"role": "user", "content": "hi"}], "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    async with httpx.AsyncClient(base_url=dp_server.url(), timeout=60) as http:
        aborts_before = abort_count((await http.get("/metrics")).text)
        async with httpx.AsyncClient(base_url=dp_server.url(), timeout=60) as doomed:
            await stream_then_leave(doomed, "/v1/messages", body, events=3,
                                    is_event=lambda line: line == "event: content_block_delta")
            start_step = dp_server.last_stats.step_id
        await _assert_engine_idle_soon(dp_server, http, start_step)
        assert abort_count((await http.get("/metrics")).text) == aborts_before + 1
