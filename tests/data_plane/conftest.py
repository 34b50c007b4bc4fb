"""Fixtures of the data-plane tests: one background engine serving three apps.

Apps: "default" (no key, unbounded), "keyed" (api_key "sk-test"),
"queue1" (max_queued_requests=1). The model's context is 2048 tokens so a
request can outlast a disconnect by far (see test_dp_disconnect.py).
"""

from __future__ import annotations

import pytest

from support.data_plane_server import API_KEY, ServerHarness


@pytest.fixture(scope="session")
def dp_server(checkpoint):
    path = checkpoint("llama", max_position_embeddings=2048)
    harness = ServerHarness(
        path,
        {"default": {}, "keyed": {"api_key": API_KEY}, "queue1": {"max_queued_requests": 1}},
        max_num_seqs=64,
    ).start()
    yield harness
    harness.stop()
