"""Tracing overhead: the mixed workload with tracing off, on and detailed, in one run.

`trillium bench throughput --tracing` (or bench/throughput.py --tracing).
One offline `trillium.LLM` (the real actors in one process) is built with an
OTLP endpoint; between runs `llm.tracing` switches the mode, exactly as
`POST /tracing` does on a server:

    off       endpoint configured, tracing disabled (no span objects at all)
    on        one llm_request span per request (the api side)
    detailed  plus queue / prefill / decode (scheduler) and detokenize spans

The spans go over real OTLP/HTTP to a sink in a child process that accepts
and discards them (a collector lives elsewhere in production: its work
should not be billed to the engine), and the sink's request and byte counts
are printed so one can see that the spans were really sent. Prefix caching
is off so each mode runs the very same requests; the order of the modes
rotates between repeats so a drifting machine favours none. Prints output
tokens/s per mode (median of --repeats) and the change against "off".
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

from tqdm import tqdm

MODES = ("off", "on", "detailed")

# The sink: POST /v1/traces -> 200, counts requests and bytes; prints
# "<requests> <bytes>" when its stdin closes.
_SINK = r"""
import http.server, sys, threading
counts = [0, 0]
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0)); self.rfile.read(n)
        counts[0] += 1; counts[1] += n
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=s.serve_forever, daemon=True).start()
print(s.server_port, flush=True)
sys.stdin.read()
print(counts[0], counts[1], flush=True)
"""


def _start_sink() -> tuple[subprocess.Popen, str]:
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(sink.stdout.readline())
    return sink, f"http://127.0.0.1:{port}/v1/traces"


def _stop_sink(sink: subprocess.Popen) -> tuple[int, int]:
    out, _ = sink.communicate(timeout=30)
    requests, num_bytes = out.split()
    return int(requests), int(num_bytes)


def _set_mode(llm, mode: str) -> None:
    llm.tracing.update(enabled=mode != "off", detailed=mode == "detailed", sample_ratio=1.0)


def run(model_dir: str, repeats: int, seed: int) -> int:
    from trillium import LLM
    from trillium.benchmarks.throughput import _run_trillium, _workload_mixed

    sink, endpoint = _start_sink()
    tps: dict[str, list[float]] = {mode: [] for mode in MODES}
    llm = None
    try:
        llm = LLM(model_dir, max_num_seqs=64, max_num_batched_tokens=1024, kv_cache_memory="1GiB",
                  enable_prefix_caching=False, otlp_traces_endpoint=endpoint)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}])  # warm-up (traced: the exporter is warm too)
        runs = [_workload_mixed(8192, seed + 1000 * r) for r in range(repeats)]
        with tqdm(total=repeats * len(MODES), desc="tracing off/on/detailed") as bar:
            for r, requests in enumerate(runs):
                for mode in MODES[r % len(MODES):] + MODES[: r % len(MODES)]:
                    _set_mode(llm, mode)
                    tps[mode].append(_run_trillium(llm, requests))
                    bar.update()
    finally:
        if llm is not None:
            llm.shutdown()  # flushes the spans still queued
        num_exports, num_bytes = _stop_sink(sink)

    import torch

    print()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, pid {os.getpid()}, "
          f"median of {repeats} runs, mixed workload (64 requests), prefix caching off")
    print(f"{'tracing':<10}{'tok/s':>10}{'vs off':>9}  runs (tok/s)")
    base = statistics.median(tps["off"])
    for mode in MODES:
        median = statistics.median(tps[mode])
        runs_text = ", ".join(f"{t:.1f}" for t in tps[mode])
        print(f"{mode:<10}{median:>10.1f}{(median / base - 1) * 100:>+8.1f}%  {runs_text}")
    print(f"OTLP sink received {num_exports} export requests, {num_bytes / 1024:.0f} KiB")
    return 0
