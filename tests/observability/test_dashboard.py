"""The Grafana dashboard against a real Prometheus scraping a live `trillium serve`.

`ops/grafana/trillium.json` is only useful if every panel's PromQL finds the
series the server exports. Here a real server (synthetic llama checkpoint)
is scraped every second by a real `prometheus` started from the shipped
`ops/prometheus/prometheus.yml` (target and interval rewritten); a short load
(completions, streams, a stop, an abort, a weight update, a sleep / wake)
makes every series exist, and each panel's query, with Grafana's variables
substituted, must return a non-empty result. A NaN value counts as data: a
quantile of a histogram without observations in the rate window is NaN,
while a query on a metric that is not exported returns nothing.

Skipped (with the reason) when no `prometheus` binary is on PATH; `make test`
installs Debian's package where it can.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.serve_process import ServeProcess, free_port
from support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "ops" / "grafana" / "trillium.json"
PROMETHEUS_CONFIG = REPO / "ops" / "prometheus" / "prometheus.yml"

ADMIN_TOKEN = "dashboard-admin-token"
LORA_NAME = "dash-adapter"
MODEL_NAME = "test-model"  # ServeProcess passes --served-model-name test-model
ROWS = ["Latency", "Throughput", "Queue and KV cache", "Control plane", "Actors"]
READY_TIMEOUT_S = 60
SCRAPES_AFTER_LOAD = 3
START_TIMEOUT_S = 300  # WHY: a second server starts beside the first one and Prometheus on 2 shared cores

# The exported metric families (the contract between the server and the dashboard).
CONTRACT_METRICS = [
    "trillium:num_requests_running", "trillium:num_requests_waiting", "trillium:num_requests_in_flight",
    "trillium:kv_cache_usage_perc", "trillium:engine_state", "trillium:is_sleeping", "trillium:is_paused",
    "trillium:weight_version_info", "trillium:profiling_active", "trillium:actor_up",
    "trillium:actor_mailbox_depth",
    "trillium:num_preemptions_total", "trillium:prefix_cache_queries_total", "trillium:prefix_cache_hits_total",
    "trillium:prompt_tokens_total", "trillium:generation_tokens_total", "trillium:request_success_total",
    "trillium:weight_updates_total",
    "trillium:time_to_first_token_seconds", "trillium:inter_token_latency_seconds",
    "trillium:e2e_request_latency_seconds", "trillium:request_queue_time_seconds",
    "trillium:request_prefill_time_seconds", "trillium:request_decode_time_seconds",
    "trillium:request_inference_time_seconds", "trillium:request_prompt_tokens",
    "trillium:request_generation_tokens", "trillium:iteration_tokens_total",
    "trillium:engine_step_duration_seconds", "trillium:weight_update_duration_seconds",
    # with --kv-host-bytes, --kv-disk-path and --enable-lora (the test's server has all three)
    "trillium:kv_tier_usage_perc", "trillium:kv_tier_hits_total", "trillium:kv_tier_evictions_total",
    "trillium:kv_tier_bytes_moved_total", "trillium:kv_tier_load_seconds", "trillium:kv_tier_failed_reads_total",
    "trillium:kv_swaps_total", "trillium:lora_requests_info", "trillium:lora_loads_total",
    "trillium:lora_unloads_total", "trillium:lora_swap_ins_total",
    # the stall watchdog (trillium serve, every actor at 0 from the start)
    "trillium:engine_stalled", "trillium:engine_stalls_total",
    # speculative decoding (at 0 without --speculative-config; the per-position family has series only with it)
    "trillium:spec_decode_num_drafts_total", "trillium:spec_decode_num_draft_tokens_total",
    "trillium:spec_decode_num_accepted_tokens_total",
]

# Grafana's variables as Prometheus would see them for this server and a 1 s scrape interval.
GRAFANA_VARIABLES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "5m",
    "model_name": MODEL_NAME,
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_METRIC_NAME = re.compile(r"trillium:[a-zA-Z0-9_:]+")
_SERIES_SUFFIXES = ("_bucket", "_sum", "_count", "_created")


# ----------------------------------------------------------------- dashboard JSON


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def walk_panels(panels: list[dict], row: str = "") -> Iterator[tuple[str, dict]]:
    """(row title, panel) for every panel, including those nested in (collapsed) rows."""
    for panel in panels:
        if panel.get("type") == "row":
            row = panel.get("title", "")
            yield from walk_panels(panel.get("panels", []), row)
        else:
            yield row, panel


def panel_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(label "row / title [refId]", expr) of every target with an expression."""
    queries = []
    for row, panel in walk_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                label = f"{row} / {panel.get('title', '?')} [{target.get('refId', '?')}]"
                queries.append((label, target["expr"]))
    return queries


def substitute(expr: str) -> str:
    def value(match: re.Match) -> str:
        name = next(group for group in match.groups() if group)
        if name not in GRAFANA_VARIABLES:
            raise KeyError(f"unknown Grafana variable ${name}")
        return GRAFANA_VARIABLES[name]

    return _VARIABLE.sub(value, expr)


def metric_family(series_name: str) -> str:
    """A series name without its type suffixes: x_total, x_bucket, x_created -> x.

    WHY: the dashboard names counters x_total and histograms x_bucket, while
    the server also exports x_created; comparing families avoids false alarms."""
    for suffix in _SERIES_SUFFIXES:
        if series_name.endswith(suffix):
            series_name = series_name[: -len(suffix)]
            break
    return series_name.removesuffix("_total")


def test_dashboard_shape():
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query"
    assert model["query"]["query"] == "label_values(trillium:num_requests_running, model_name)"
    assert model["datasource"]["uid"] == "${datasource}"

    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ROWS

    panels = list(walk_panels(dashboard["panels"]))
    ids = [p["id"] for p in dashboard["panels"] if p["type"] == "row"] + [p["id"] for _, p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    problems = []
    for row, panel in panels:
        where = f"{row} / {panel['title']}"
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"{where}: panel datasource is not ${{datasource}}")
        if not panel.get("targets"):
            problems.append(f"{where}: no query")
        for target in panel.get("targets", []):
            if target.get("datasource", {}).get("uid") != "${datasource}":
                problems.append(f"{where} [{target.get('refId')}]: target datasource is not ${{datasource}}")
            try:
                substitute(target.get("expr", ""))
            except KeyError as exc:
                problems.append(f"{where} [{target.get('refId')}]: {exc}")
        pos = panel["gridPos"]
        if pos["x"] + pos["w"] > 24:
            problems.append(f"{where}: gridPos wider than the 24-column grid")
    assert not problems, "\n".join(problems)

    used = {metric_family(name) for _, expr in panel_queries(dashboard) for name in _METRIC_NAME.findall(expr)}
    unused = sorted({metric_family(name) for name in CONTRACT_METRICS} - used)
    assert not unused, f"metrics of the contract without a panel: {unused}"


# ----------------------------------------------------------------- live server + Prometheus


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no `prometheus` binary on PATH (Debian: apt-get install prometheus; `make test` tries that "
                    "when run as root)")
    return binary


@pytest.fixture(scope="module")
def model_path(checkpoint) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def server(prometheus_binary, model_path, tmp_path_factory):
    from trillium.benchmarks.lora import write_adapter
    from trillium.models.loader import load_model_config

    adapter = write_adapter(str(tmp_path_factory.mktemp("dash-lora") / "dash"), load_model_config(model_path),
                            rank=4, seed=0)
    # WHY a 24-block device cache, a 6-block host tier and a disk tier: the load evicts a long
    # prompt's 7 blocks through the host to the disk and asks for it again, so every kv_tier_*
    # series moves; one LoRA adapter for lora_*.
    disk = tmp_path_factory.mktemp("dash-kv-disk")
    proc = ServeProcess(str(model_path), "--admin-token", ADMIN_TOKEN, "--kv-cache-memory", "192KiB",
                        "--kv-host-bytes", "48KiB", "--kv-disk-path", str(disk), "--kv-disk-bytes", "4MiB",
                        "--enable-lora", "--max-lora-rank", "4",
                        "--lora-modules", f"{LORA_NAME}={adapter}",
                        "--max-num-seqs", "8", "--executor-threads", "1")
    try:
        proc.wait_healthy()
        wait_for(lambda: admin(proc, "GET", "/health").status_code == 200, "the admin port to answer")
    except BaseException:
        proc.stop()
        raise
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def prometheus(prometheus_binary, server, tmp_path_factory):
    """A real Prometheus scraping the server's data plane every second; yields its base URL."""
    with running_prometheus(prometheus_binary, server, tmp_path_factory.mktemp("prometheus")) as url:
        yield url


@contextlib.contextmanager
def running_prometheus(prometheus_binary: str, server: ServeProcess, workdir: Path) -> Iterator[str]:
    config = PROMETHEUS_CONFIG.read_text()
    for shipped, test_value in [("127.0.0.1:8000", f"127.0.0.1:{server.port}"),
                                ("scrape_interval: 5s", "scrape_interval: 1s"),
                                ("evaluation_interval: 5s", "evaluation_interval: 1s")]:
        assert shipped in config, f"{PROMETHEUS_CONFIG} no longer holds {shipped!r}"
        config = config.replace(shipped, test_value)
    (workdir / "prometheus.yml").write_text(config)
    port = free_port()
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [prometheus_binary, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"prometheus exited {process.returncode}:\n{log_path.read_text()[-3000:]}")
            return httpx.get(url + "/-/ready", timeout=2).status_code == 200

        wait_for(ready, "prometheus to be ready")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for(condition, what: str) -> None:
    """Poll `condition` every 0.2 s (HTTP errors count as not yet) until it holds; fail after READY_TIMEOUT_S."""
    wait_until(condition, timeout_s=READY_TIMEOUT_S, interval_s=0.2, what=what, ignoring=(httpx.HTTPError,))


def admin(server: ServeProcess, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, server.admin_url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                         timeout=60, **kwargs)


def admin_ok(server: ServeProcess, method: str, path: str, **kwargs) -> dict:
    reply = admin(server, method, path, **kwargs)
    assert reply.status_code == 200, f"{method} {path}: {reply.status_code} {reply.text}"
    return reply.json()


def query(prometheus_url: str, promql: str) -> list[dict]:
    reply = httpx.get(prometheus_url + "/api/v1/query", params={"query": promql}, timeout=10)
    body = reply.json()
    if body.get("status") != "success":
        raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


def scalar(prometheus_url: str, promql: str) -> float | None:
    result = query(prometheus_url, promql)
    return float(result[0]["value"][1]) if result else None


def server_samples(server: ServeProcess) -> dict[str, float]:
    """{sample name: value summed over labels} from the server's own /metrics."""
    totals: dict[str, float] = {}
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def drive_load(server: ServeProcess, model_path: Path) -> None:
    """~20 completions (plain, streamed, stopped, one hung up), a weight update, a sleep and a wake."""
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        def complete(**overrides) -> dict:
            reply = client.post("/v1/completions", json={**body, **overrides})
            assert reply.status_code == 200, reply.text
            return reply.json()

        def stream(**overrides) -> None:
            with client.stream("POST", "/v1/completions", json={**body, **overrides, "stream": True}) as reply:
                assert reply.status_code == 200, reply.read()
                for _ in reply.iter_lines():
                    pass

        greedy_text = complete()["choices"][0]["text"].strip()
        # WHY: greedy output repeats, so a stop string taken from its first 8 tokens is met before
        # max_tokens=16 can end the request: finished_reason "stop", not a tie with "length".
        stop = greedy_text[len(greedy_text) // 2:][:1] or "e"
        for i in range(16):
            prompt = f"The little dog number {i} said"
            if i % 4 == 0:
                stream(prompt=prompt)
            elif i % 4 == 1:
                complete(max_tokens=16, stop=[stop])
            elif i % 4 == 2:
                complete(prompt=prompt, max_tokens=12, temperature=1.0, seed=i)
            else:
                complete(prompt="Once upon a time, a prefix shared by requests " + str(i))
        # A client that hangs up after the first chunk: finished_reason "abort".
        hang_up = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=hang_up) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    break

        # KV tiers: a long prompt, others that push its blocks off the device and the host, then it again.
        long_prompts = [[5 + (7 * i + k) % 400 for k in range(120)] for i in range(6)]
        for prompt in [*long_prompts, long_prompts[0]]:
            complete(prompt=prompt, max_tokens=2)
        for i in range(3):
            complete(model=LORA_NAME, prompt=f"An adapter answer {i}")

        admin_ok(server, "POST", "/update_weights_from_disk", json={"model_path": str(model_path)})
        admin_ok(server, "POST", "/sleep", json={"level": 1})
        admin_ok(server, "POST", "/wake_up")
        for _ in range(3):
            complete()

    wait_for(lambda: server_samples(server).get("trillium:num_requests_in_flight") == 0,
               "the server to finish every request")
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    loaded = [line for line in text.splitlines()
              if line.startswith("trillium:kv_tier_bytes_moved_total") and 'direction="to_device"' in line]
    assert loaded and float(loaded[0].rsplit(" ", 1)[1]) > 0, "the long prompt never came back from the host tier"
    hits = [line for line in text.splitlines() if line.startswith("trillium:kv_tier_hits_total") and 'tier="disk"' in line]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) > 0, "the long prompt never came back from the disk tier"
    assert server_samples(server)["trillium:lora_swap_ins_total"] > 0, "the adapter never went into a slot"


@pytest.fixture(scope="module")
def scraped(server, prometheus, model_path) -> str:
    """Prometheus URL once it has scraped the load's final counts and SCRAPES_AFTER_LOAD more times."""
    drive_load(server, model_path)
    finished = server_samples(server).get("trillium:request_success_total", 0.0)
    assert finished >= 20, f"the server counted {finished} finished requests"
    scrapes_query = 'count_over_time(up{job="trillium"}[10m])'
    scrapes_at_end = scalar(prometheus, scrapes_query) or 0
    wait_for(lambda: scalar(prometheus, "sum(trillium:request_success_total)") == finished,
               f"prometheus to scrape request_success_total == {finished}")
    wait_for(lambda: (scalar(prometheus, scrapes_query) or 0) >= scrapes_at_end + SCRAPES_AFTER_LOAD,
               f"{SCRAPES_AFTER_LOAD} more scrapes")
    assert scalar(prometheus, 'up{job="trillium"}') == 1
    return prometheus


@pytest.mark.prometheus
def test_every_panel_returns_data(scraped):
    assert_every_panel_has_data(scraped)


def assert_every_panel_has_data(prometheus_url: str) -> None:
    dashboard = load_dashboard()
    exported = {metric_family(name) for name in query_label_values(prometheus_url)}
    queries = panel_queries(dashboard)
    assert len(queries) >= 30
    failures = []
    for label, expr in queries:
        missing = sorted({metric_family(m) for m in _METRIC_NAME.findall(expr)} - exported)
        if missing:
            failures.append(f"{label}: not exported by the server: {', '.join(missing)}")
            continue
        promql = substitute(expr)
        try:
            result = query(prometheus_url, promql)
        except ValueError as exc:
            failures.append(f"{label}: query error {exc}\n    {promql}")
            continue
        if not result:
            failures.append(f"{label}: empty result\n    {promql}")
    assert not failures, f"{len(failures)} of {len(queries)} panel queries fail:\n" + "\n".join(failures)


@pytest.mark.prometheus
def test_every_panel_has_data_on_a_fresh_server(prometheus_binary, model_path, tmp_path_factory):
    """No load, no KV tiers, no LoRA: every family is exported from start-up (at 0), so each
    panel's query returns data and rate() has a baseline (issue 16, item 7)."""
    server = ServeProcess(str(model_path), "--kv-cache-memory", "1MiB", "--executor-threads", "1").wait_healthy(
        timeout_s=START_TIMEOUT_S)
    try:
        with running_prometheus(prometheus_binary, server, tmp_path_factory.mktemp("prometheus-fresh")) as url:
            wait_for(lambda: (scalar(url, 'count_over_time(up{job="trillium"}[10m])') or 0) >= SCRAPES_AFTER_LOAD,
                     f"{SCRAPES_AFTER_LOAD} scrapes of the fresh server")
            assert_every_panel_has_data(url)
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.prometheus
def test_every_exported_family_has_a_panel(scraped):
    used = {metric_family(m) for _, expr in panel_queries(load_dashboard()) for m in _METRIC_NAME.findall(expr)}
    exported = {metric_family(name) for name in query_label_values(scraped)}
    assert not exported - used, f"exported without a panel: {sorted(exported - used)}"


def query_label_values(prometheus_url: str) -> list[str]:
    """Every trillium:* series name Prometheus has scraped."""
    reply = httpx.get(prometheus_url + "/api/v1/label/__name__/values", timeout=10).json()
    return [name for name in reply["data"] if name.startswith("trillium:")]
