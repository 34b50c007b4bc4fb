"""A real engine and data-plane apps in a background trio thread, for HTTP tests.

The wiring is `trillium.LLM._engine_main`'s (EngineClient + run_in_process
over inproc://) plus one `create_app` / `serve_app` per app configuration,
all on 127.0.0.1 with port 0. One engine serves every app, so the apps'
per-app metric registries and admission counts are exercised side by side.

Tests talk HTTP to `harness.url(name)`; `harness.call(afn)` runs a coroutine
on the engine's loop (direct EngineClient runs to compare against);
`harness.wait_until(condition, what)` polls the engine's state from a test.
`stream_then_leave` / `abort_count`: the client-gone-mid-stream tests' shared steps
(test_dp_disconnect.py, test_dp_async_scheduling.py, test_dp_multi_step.py).
"""

from __future__ import annotations

import functools
import threading

import trio

from support.waiting import wait_until_async
from trillium.actors.client import EngineClient
from trillium.actors.assembly import ActorConfig, Addresses, engine_specs
from trillium.actors.supervisor import run_in_process
from trillium.config import EngineConfig
from trillium.data_plane import DataPlaneEngine, create_app, serve_app
from trillium.data_plane.app import app_state
from trillium.models.loader import load_model_config
from trillium.models.tokenizer import load_tokenizer
from trillium.pooling.outputs import PoolingModel

MODEL_NAME = "tiny-llama"
API_KEY = "sk-test"
# The tool-call parsers tried end to end (data_plane/test_dp_tool_parsers_e2e.py) on apps of
# their own; hermes runs in test_dp_tools_serve.py's `trillium serve`, which covers the CLI flags.
TOOL_PARSER_APPS = ("llama3_json", "mistral", "pythonic")
# The "messages" app's template (tests/data_plane/test_dp_anthropic_messages.py): it renders the system
# prompt, tools, assistant thinking and tool calls, tool results, and opens a <think> block when
# enable_thinking is true, else writes a closed one (as Qwen3's does).
MESSAGES_TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{{ t.function.parameters | tojson }}"
    "{% endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{% endif %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{\"name\": "
    "\"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments }}}</tool_call>{% endfor %}<|end|>"
    "{%- elif m.role == 'tool' %}<|user|><tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response>"
    "<|end|>{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
TOOLS_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                  "{% if tools %}<|system|>{{ tools | tojson }}<|end|>{% endif %}<|assistant|>")


def data_event(line: str) -> bool:
    """An SSE data line carrying a JSON object (a chunk, not `[DONE]`)."""
    return line.startswith("data: {")


async def stream_then_leave(client, path: str, body: dict, events: int, is_event=data_event) -> list[str]:
    """POST `body` to `path` as a stream, read lines until `events` of them satisfy `is_event`, then
    leave: the response closes mid-stream, as a client that goes away. Those lines."""
    seen: list[str] = []
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if is_event(line):
                seen.append(line)
                if len(seen) >= events:
                    break
    return seen


def abort_count(metrics_text: str) -> float:
    """trillium:request_success_total{finished_reason="abort"} in a /metrics page (0 before the first)."""
    for line in metrics_text.splitlines():
        if line.startswith('trillium:request_success_total{finished_reason="abort"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class ServerHarness:
    def __init__(self, model_path, apps: dict[str, dict], **engine_args) -> None:
        self.model_path = str(model_path)
        self._apps_spec = apps
        self._engine_args = engine_args
        self.ports: dict[str, int] = {}
        self.apps: dict = {}
        self.client: EngineClient | None = None
        self.tokenizer = None
        self._failure: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="dp-harness", daemon=True)

    # -- lifecycle --------------------------------------------------------

    def start(self) -> "ServerHarness":
        self._thread.start()
        self._ready.wait(timeout=120)
        if self._failure is not None or not self.ports:
            raise RuntimeError(f"harness failed to start: {self._failure!r}")
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join(timeout=30)

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self._failure = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        config = EngineConfig(
            model=self.model_path, served_model_name=MODEL_NAME, num_threads=1, **self._engine_args
        ).resolve()
        actor_config = ActorConfig(config, Addresses.inproc())
        client = EngineClient(actor_config)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(client.run)
                supervision = await nursery.start(run_in_process, engine_specs(actor_config))
                self.client = client
                self.tokenizer = load_tokenizer(self.model_path)
                vocab_size = load_model_config(self.model_path).vocab_size
                for name, overrides in self._apps_spec.items():
                    engine = DataPlaneEngine(
                        client=client, tokenizer=self.tokenizer, served_model_name=config.served_model_name,
                        max_model_len=config.max_model_len, vocab_size=vocab_size,
                        health=lambda: (supervision.healthy, dict(supervision.alive)),
                        pooling=PoolingModel.build(config), **overrides,
                    )
                    app = create_app(engine)
                    self.apps[name] = app
                    self.ports[name] = await nursery.start(serve_app, app, "127.0.0.1", 0)
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        finally:
            client.close()

    # -- helpers for tests ------------------------------------------------

    def url(self, name: str = "default") -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def num_in_flight(self, name: str = "default") -> int:
        """HTTP requests the app counts as in the engine (read across threads: an int)."""
        return len([g for g in app_state(self.apps[name]).inflight._generations if not g.finished])

    @property
    def last_stats(self):
        return self.client.last_stats

    async def wait_until(self, condition, what: str, timeout_s: float = 30.0) -> None:
        """Poll `condition` every 5 ms from a test's trio loop.

        WHY poll: the engine and apps run on this harness's own thread and loop,
        so the test cannot await their state.
        """
        await wait_until_async(condition, timeout_s=timeout_s, interval_s=0.005, what=what)

    async def probe_until_idle(self, http, timeout_s: float = 30.0):
        """Once no HTTP request is in the engine, send 1-token completions (each makes the engine
        step and report stats) until nothing runs or waits; the last SchedulerStats. WHY probes:
        stats come with steps, so an idle engine reports nothing new by itself."""
        await self.wait_until(lambda: self.num_in_flight() == 0, "no request in flight")
        with trio.fail_after(timeout_s):
            while True:
                probe = await http.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
                assert probe.status_code == 200
                stats = self.last_stats
                if stats.num_running == 0 and stats.num_waiting == 0:
                    return stats

    async def call(self, afn, *args):
        """Run `afn(*args)` on the engine's trio loop from a test's loop."""
        run = functools.partial(trio.from_thread.run, afn, *args, trio_token=self._token)
        return await trio.to_thread.run_sync(run)
