"""Grammar gate: a constrained request waits in the queue until its grammar is compiled.

A component of the scheduler core (the design: trillium/structured_outputs.py).
The executor compiles grammars on its own threads; this gate only keeps the
scheduler's view of which grammars it holds, by `StructuredOutputsParams.key`:

    add(request)        new constrained request: its key is queued for compile
                        unless ready or already on its way
    take_compiles()     keys for this step's ExecuteBatch.compile_grammars
    ready(request)      Admission skips (puts back, takes the next) a request
                        whose grammar is not ready; it never blocks the others
    must_poll()         compiles are out: with nothing else to run, the core
                        still sends an empty step, and the executor waits a
                        little for a compile there (as for disk reads)
    step_done(result)   BatchResult.grammars_ready / _failed / _evicted;
                        returns the failed keys and why

State: three sets of keys (ready, sent and not answered, to send). A request
the executor already knows (it ran, then was preempted) is always ready: its
matcher lives in its sampling state there. An evicted key is compiled again
when a request that still waits for it is next considered.

Pure synchronous code: no trio, no zmq, no torch.
"""

from __future__ import annotations

from trillium.actors.protocol.execute import BatchResult
from trillium.actors.scheduler.request import Request


def grammar_key(request: Request) -> str | None:
    constraint = request.sampling.structured_outputs
    return None if constraint is None else constraint.key


class GrammarGate:
    def __init__(self) -> None:
        self._ready: set[str] = set()
        self._sent: set[str] = set()
        self._to_send: dict[str, None] = {}  # insertion-ordered set

    def add(self, request: Request) -> None:
        key = grammar_key(request)
        if key is not None and key not in self._ready and key not in self._sent:
            self._to_send[key] = None

    def ready(self, request: Request) -> bool:
        key = grammar_key(request)
        if key is None or request.known_to_executor or key in self._ready:
            return True
        self.add(request)  # WHY: its grammar may have been evicted since it arrived
        return False

    def take_compiles(self) -> tuple[str, ...]:
        keys = tuple(self._to_send)
        self._to_send.clear()
        self._sent.update(keys)
        return keys

    def must_poll(self) -> bool:
        return bool(self._to_send or self._sent)

    def step_done(self, result: BatchResult) -> dict[str, str]:
        for key in result.grammars_evicted:
            self._ready.discard(key)
        for key in result.grammars_ready:
            self._sent.discard(key)
            self._ready.add(key)
        for key in result.grammars_failed:
            self._sent.discard(key)
        return result.grammars_failed


__all__ = ["GrammarGate", "grammar_key"]
