"""The engine lifecycle's words, shared by every boundary (no messages here).

    EngineState  the state the scheduler reports (SchedulerStats.engine_state,
                 the `state` of every ControlReply's data)
    PauseMode    what a Pause / Sleep does to the requests in flight
    WakeTag      what a WakeUp brings back (and what is still asleep)

The transitions between states live in `scheduler/engine_state.py`; the
messages that carry these words in `admin.py` and `outputs.py`.

WHY `StrEnum`: the value is the wire and HTTP spelling. The codec sends
the value and decodes it back to the member; `json.dumps`, f-strings and
Prometheus labels see the plain string; a member compares equal to its
string, so a caller holding "serving" (an HTTP body, a test) still matches.
"""

from __future__ import annotations

import enum


class EngineState(enum.StrEnum):
    SERVING = "serving"  # admit and step
    PAUSED = "paused"  # no steps; requests (frozen or new) wait in the queue
    DRAINING = "draining"  # step the requests a drain waits for; hold the others
    SLEEPING = "sleeping"  # no steps; KV cache (and maybe weights) released
    UPDATING_WEIGHTS = "updating_weights"  # no steps; the executor is swapping weights


class PauseMode(enum.StrEnum):
    ABORT = "abort"  # requests in flight end now (finish_reason "abort")
    WAIT = "wait"  # the started requests finish first (a drain)
    KEEP = "keep"  # requests in flight freeze and continue after resume
    # requests in flight go back to the queue (KV freed) and recompute after
    # resume: SGLang's pause_generation mode "retract"
    RETRACT = "retract"


class WakeTag(enum.StrEnum):
    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


ALL_WAKE_TAGS: tuple[WakeTag, ...] = tuple(WakeTag)


# RequestDelta.stop_reason prefix of a request the scheduler dropped after waiting
# longer than --max-queue-time-s (scheduler/queue_timeout.py); the api answers 503.
QUEUE_TIMEOUT_REASON = "queue_timeout"
