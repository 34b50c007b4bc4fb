"""The `speculative` request field (Trillium's per-request opt-out of speculative decoding):
a boolean is accepted on completions and chat; any other type is a 400 naming it
(test_dp_errors.py). vLLM has no such field; its engine-side effect is tested in
tests/test_llm_speculative.py."""

from __future__ import annotations

import httpx

from support.data_plane_server import MODEL_NAME


async def test_speculative_false_is_accepted(dp_server):
    async with httpx.AsyncClient(base_url=dp_server.url(), timeout=60) as client:
        done = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 2,
                                                          "speculative": False})
        chat = await client.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "speculative": True})
    assert done.status_code == 200, done.text
    assert chat.status_code == 200, chat.text
