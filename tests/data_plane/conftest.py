"""Fixtures of the data-plane tests: one background engine serving three apps.

Apps: "default" (no key, unbounded), "keyed" (api_key "sk-test"),
"queue1" (max_queued_requests=1), and "tools-<parser>" (a tools chat template,
--enable-auto-tool-choice with that --tool-call-parser), "messages" (support/data_plane_server.py's
MESSAGES_TEMPLATE, hermes tool calls, the qwen3 reasoning parser), "reasoning" (--reasoning-parser
deepseek_r1) and "store2" (--responses-store-size 2; test_dp_responses.py). The model's context is 2048 tokens so a
request can outlast a disconnect by far (see test_dp_disconnect.py).
"""

from __future__ import annotations

import pytest

from support.data_plane_server import API_KEY, MESSAGES_TEMPLATE, TOOL_PARSER_APPS, TOOLS_TEMPLATE, ServerHarness
from trillium.data_plane.chat_options import ChatOptions


@pytest.fixture(scope="session")
def dp_server(checkpoint):
    path = checkpoint("llama", max_position_embeddings=2048)
    apps = {"default": {}, "keyed": {"api_key": API_KEY}, "queue1": {"max_queued_requests": 1}}
    for parser in TOOL_PARSER_APPS:
        apps[f"tools-{parser}"] = {"chat": ChatOptions.build(
            chat_template=TOOLS_TEMPLATE, enable_auto_tool_choice=True, tool_call_parser=parser)}
    apps["messages"] = {"chat": ChatOptions.build(chat_template=MESSAGES_TEMPLATE, enable_auto_tool_choice=True,
                                                  tool_call_parser="hermes", reasoning_parser="qwen3")}
    apps["reasoning"] = {"chat": ChatOptions.build(reasoning_parser="deepseek_r1")}
    apps["store2"] = {"responses_store_size": 2}
    harness = ServerHarness(path, apps, max_num_seqs=64).start()
    yield harness
    harness.stop()
