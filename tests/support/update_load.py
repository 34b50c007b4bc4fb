"""Streamed greedy completions in threads while a weight update runs (test helper).

Used by the weight-update-under-load tests (control_plane/test_cp_weights.py,
control_plane/test_cp_data_parallel.py): every response must report one
version and that version's text.
"""

from __future__ import annotations

import json
import threading
import time

from support.admin_server import API_KEY, MAX_TOKENS, MODEL_NAME, PROMPTS
from support.waiting import wait_until


class UpdateLoad:
    """`num_workers` threads sending greedy streamed completions of PROMPTS until `stop` is set;
    each finished one is a record: its prompt, start time, X-Weight-Version header, the versions its
    chunks report and its text."""

    def __init__(self, server, num_workers: int = 16) -> None:
        self.server = server
        self.records: list[dict] = []
        self.num_refused = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(num_workers)]

    def _worker(self, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            prompt_index = (index + n) % len(PROMPTS)
            n += 1
            started_s = time.monotonic()
            body = {"model": MODEL_NAME, "prompt": PROMPTS[prompt_index], "max_tokens": MAX_TOKENS,
                    "temperature": 0, "stream": True}
            with self.server.http.stream("POST", self.server.base_url + "/v1/completions", json=body,
                                         headers={"Authorization": f"Bearer {API_KEY}"}) as response:
                if response.status_code == 503:
                    response.read()
                    self.num_refused += 1
                    time.sleep(0.05)
                    continue
                assert response.status_code == 200
                chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
            self.records.append({
                "prompt_index": prompt_index, "started_s": started_s, "header": response.headers["X-Weight-Version"],
                "versions": {c["weight_version"] for c in chunks},
                "text": "".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
            })

    def wait_for(self, count: int, since_s: float = 0.0, timeout_s: float = 120) -> None:
        wait_until(lambda: sum(r["started_s"] > since_s for r in self.records) >= count, timeout_s=timeout_s,
                   interval_s=0.05, what=f"{count} more completed requests of the load")
