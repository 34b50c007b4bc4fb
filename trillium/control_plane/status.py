"""The api process's view of the engine's lifecycle state and weight version.

The engine reports both in every `SchedulerStats` (client.last_stats), but
stats only arrive after a step or when the scheduler goes idle, so right
after a command they can still describe the state before it. This object
closes that gap, for the control plane and (through `snapshot`, which
`trillium serve` hands to the data plane) for admission:

1. While a command that must stop admission runs (sleep, pause, a weight
   update), `closing(state)` reports that state at once: the data plane
   answers 503 before the command even reaches the engine.
2. When a reply arrives, `settle(state, weight_version)` records what it
   implies, tied to the stats message current at that moment.
3. As soon as a newer stats message arrives, it wins. WHY this is safe: the
   scheduler sends its replies and its stats on the same socket, in order,
   so stats that arrive after a reply were computed after the command.

Everything here runs on the api process's trio loop: no locks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import attrs

from trillium.actors.protocol.vocabulary import EngineState

INITIAL_WEIGHT_VERSION = "0"


@attrs.frozen
class _Settled:
    state: EngineState
    weight_version: str
    basis: object  # the stats message current when the reply arrived


class EngineStatus:
    def __init__(self, stats: Callable[[], object | None]) -> None:
        self._stats = stats
        self._closing: list[EngineState] = []
        self._settled: _Settled | None = None

    def _current_settled(self) -> _Settled | None:
        if self._settled is not None and self._stats() is not self._settled.basis:
            self._settled = None  # newer stats arrived: they describe the engine after the reply
        return self._settled

    def _reported(self) -> tuple[EngineState, str]:
        settled = self._current_settled()
        if settled is not None:
            return settled.state, settled.weight_version
        stats = self._stats()
        if stats is None:
            return EngineState.SERVING, INITIAL_WEIGHT_VERSION
        return EngineState(stats.engine_state), stats.weight_version

    @property
    def engine_state(self) -> EngineState:
        """The state to act on: a closing command's state first, then the engine's."""
        return self._closing[-1] if self._closing else self._reported()[0]

    @property
    def settled_state(self) -> EngineState:
        """The engine's state ignoring commands still in flight."""
        return self._reported()[0]

    @property
    def weight_version(self) -> str:
        return self._reported()[1]

    @property
    def is_sleeping(self) -> bool:
        return self.settled_state == EngineState.SLEEPING

    @property
    def is_paused(self) -> bool:
        return self.settled_state == EngineState.PAUSED

    def snapshot(self) -> tuple[EngineState, str]:
        """(engine_state, weight_version): the data plane's admission probe."""
        return self.engine_state, self.weight_version

    @contextlib.contextmanager
    def closing(self, state: EngineState | str) -> Iterator[None]:
        """Report `state` (so admission stops) while the block runs."""
        state = EngineState(state)
        self._closing.append(state)
        try:
            yield
        finally:
            self._closing.remove(state)

    def settle(self, state: EngineState | str | None = None, weight_version: str | None = None) -> None:
        """Record what a reply implies (a reply's data carries the state's string);
        None keeps what is reported now."""
        current_state, current_version = self._reported()
        state = EngineState(state) if state else current_state
        self._settled = _Settled(state, weight_version or current_version, self._stats())
