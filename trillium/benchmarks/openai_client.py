"""Streaming /v1/completions client of `trillium bench serving --base-url` (any OpenAI-compatible server).

Role: send one workload (prompts as token-id lists or text, each with its
max_tokens, greedy, `ignore_eos`) to one server as streaming completions,
all at once or as Poisson arrivals at `--request-rate`, at most
`--max-concurrency` in flight, and time each request's chunks. vLLM's
`vllm bench serve` (vllm/benchmarks/serve.py) does the same against the same
endpoint; llama.cpp's llama-server and vLLM both accept a list of ints as
`prompt` and the `ignore_eos` field.

In: a base URL, a model name, [(prompt, max_tokens)]. Out: the elapsed
seconds and one RequestTiming per request, or BenchError (a server that is
down, answers an HTTP error, or sends an error event): a message for the
user, never a traceback. `summarize` turns timings into the JSON-safe
numbers the table, the plot and `--save-result` show. No state across calls.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import time

import attrs


class BenchError(Exception):
    """The server could not be benchmarked (unreachable, HTTP error, error event): exit 1 with this message."""


@attrs.define
class RequestTiming:
    start: float
    expected_tokens: int
    first_token: float | None = None
    chunk_times: list[float] = attrs.field(factory=list)
    end: float = 0.0
    completion_tokens: int | None = None  # from the usage chunk; None when the server sent none


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default, which
    vLLM's benchmark uses); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(elapsed: float, timings: list[RequestTiming]) -> dict:
    """Request/token throughput and TTFT / inter-token latency (ms: mean, p50, p99) of one run.

    ITL is the gap between consecutive chunks that carry text (a chunk may hold
    more than one token, as in vLLM's benchmark). completion_tokens is the sum
    of the servers' usage counts, or of text chunks where a request got no usage."""
    ttft = [(t.first_token - t.start) * 1000 for t in timings if t.first_token is not None]
    itl = [(b - a) * 1000 for t in timings for a, b in zip(t.chunk_times, t.chunk_times[1:])]
    tokens = sum(t.completion_tokens if t.completion_tokens is not None else len(t.chunk_times) for t in timings)
    out = {
        "num_requests": len(timings), "duration_s": elapsed,
        "completion_tokens": tokens, "expected_completion_tokens": sum(t.expected_tokens for t in timings),
        "usage_reported": all(t.completion_tokens is not None for t in timings),
        "req_s": len(timings) / elapsed if elapsed > 0 else float("nan"),
        "tok_s": tokens / elapsed if elapsed > 0 else float("nan"),
    }
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl)):
        out[f"{name}_mean"] = statistics.fmean(values) if values else float("nan")
        out[f"{name}_p50"] = percentile(values, 50)
        out[f"{name}_p99"] = percentile(values, 99)
    return out


def _chunk_has_text(line: str, timing: RequestTiming) -> bool:
    """Whether one `data: ...` SSE line carries generated text; records its usage, raises on an error event."""
    # WHY no JSON parse of every chunk: the client shares the cores with the server it
    # measures. A compact Trillium/vLLM chunk says whether it carries text; anything
    # else (the usage chunk, other servers' spacing, error events) is parsed.
    if '"usage":null' in line and '"text":"' in line:
        return '"text":""' not in line
    try:
        chunk = json.loads(line[6:])
    except json.JSONDecodeError as e:
        raise BenchError(f"the server sent a stream line that is not JSON: {line[:200]!r}") from e
    if not isinstance(chunk, dict):
        raise BenchError(f"the server sent an unexpected stream event: {line[:200]!r}")
    if chunk.get("error"):
        raise BenchError(f"the server sent an error event: {json.dumps(chunk['error'])[:300]}")
    if chunk.get("usage"):
        timing.completion_tokens = int(chunk["usage"]["completion_tokens"])
    choices = chunk.get("choices") or []
    return bool(choices and choices[0].get("text"))


async def _one(session, url: str, model: str, prompt, max_tokens: int) -> RequestTiming:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    timing = RequestTiming(start=time.perf_counter(), expected_tokens=max_tokens)
    async with session.post(url, json=body) as response:
        if response.status >= 400:
            text = (await response.text())[:300]
            raise BenchError(f"{url} answered HTTP {response.status}: {text}")
        async for raw in response.content:  # one SSE line at a time
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            now = time.perf_counter()
            if _chunk_has_text(line if line.startswith("data: ") else "data: " + line[5:], timing):
                if timing.first_token is None:
                    timing.first_token = now
                timing.chunk_times.append(now)
    timing.end = time.perf_counter()
    return timing


def _headers() -> dict[str, str]:
    """Authorization from OPENAI_API_KEY when set (as vLLM's benchmark client does), for keyed servers."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _connection_error(base_url: str, e: Exception) -> BenchError:
    return BenchError(f"cannot reach {base_url}: {e.__class__.__name__}: {e} (is the server running?)")


async def first_model_id(base_url: str, timeout_s: float = 30.0) -> str:
    """The first id of GET /v1/models (what `--model` defaults to)."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                         headers=_headers()) as session:
            async with session.get(base_url + "/v1/models") as response:
                if response.status >= 400:
                    text = (await response.text())[:300]
                    raise BenchError(f"{base_url}/v1/models answered HTTP {response.status}: {text}")
                listing = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise _connection_error(base_url, e) from e
    except ValueError as e:
        raise BenchError(f"{base_url}/v1/models did not answer JSON: {e}") from e
    models = listing.get("data") if isinstance(listing, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


async def run_workload(base_url: str, endpoint: str, model: str, reqs, *, request_rate: float = math.inf,
                       max_concurrency: int | None = None, seed: int = 0,
                       timeout_s: float = 600.0) -> tuple[float, list[RequestTiming]]:
    """Send `reqs` ((prompt, max_tokens) pairs) and return (elapsed s, timings in request order).

    WHY aiohttp (as vLLM's benchmark client): its C HTTP parser costs half the CPU
    per streamed chunk of a pure-Python client, and the client competes with the
    server it measures."""
    import aiohttp

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = base_url + endpoint

    async def limited(session, prompt, max_tokens):
        if limit is None:
            return await _one(session, url, model, prompt, max_tokens)
        async with limit:
            return await _one(session, url, model, prompt, max_tokens)

    # WHY force_close (a connection per request, as vLLM's benchmarks/backend_request_func.py opens
    # a session per request):
    # llama-server closes a keep-alive connection after a few requests, and a request sent on
    # one it has just closed fails with ServerDisconnectedError mid-run.
    connector = aiohttp.TCPConnector(limit=(max_concurrency or len(reqs)) + 4, force_close=True)
    tasks: list[asyncio.Task] = []
    try:
        async with aiohttp.ClientSession(connector=connector, headers=_headers(),
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            start = time.perf_counter()
            for prompt, max_tokens in reqs:
                tasks.append(asyncio.create_task(limited(session, prompt, max_tokens)))
                if math.isfinite(request_rate) and request_rate > 0:
                    await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
            try:
                timings = list(await asyncio.gather(*tasks))
            except BaseException:
                # NOTE: one failed request fails the run; stop the others before the session closes.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            return time.perf_counter() - start, timings
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError) as e:
        raise _connection_error(base_url, e) from e
    except asyncio.TimeoutError as e:
        raise BenchError(f"{url}: a request took longer than --timeout {timeout_s:g} s") from e
    except aiohttp.ClientError as e:
        raise BenchError(f"{url}: {e.__class__.__name__}: {e}") from e
