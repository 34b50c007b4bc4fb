"""Typed messages, one module per actor boundary.

    requests.py   api -> scheduler, detokenizer -> scheduler (AddRequest, AbortRequest, FinishRequest)
    execute.py    scheduler <-> executor (ExecuteBatch, BatchResult, ...)
    outputs.py    scheduler -> detokenizer -> api (TokenDeltas, RequestOutputs, SchedulerStats)
    supervision.py  messages every actor understands (Shutdown, Ping/Pong)
    admin.py      control-plane commands: sleep / wake, pause, weight updates, profiling
    vocabulary.py the lifecycle's words (EngineState, PauseMode, WakeTag), no messages

`ALL_MESSAGE_TYPES` is what the engine's codec registers.
"""

from trillium.actors.protocol import admin, execute, outputs, requests, supervision

ALL_MESSAGE_TYPES: tuple[type, ...] = (
    *requests.MESSAGES,
    *execute.MESSAGES,
    *outputs.MESSAGES,
    *supervision.MESSAGES,
    *admin.MESSAGES,
)
