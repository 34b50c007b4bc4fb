"""Typed messages, one module per actor boundary.

    requests.py   api -> scheduler, detokenizer -> scheduler (AddRequest, AbortRequest, FinishRequest)
    execute.py    scheduler <-> executor (ExecuteBatch, BatchResult, ...)
    outputs.py    scheduler -> detokenizer -> api (TokenDeltas, RequestOutputs, SchedulerStats)
    supervision.py  messages every actor understands (Shutdown, Ping/Pong)
    admin.py      control-plane commands: sleep / wake, pause, weight updates, profiling
    rejections.py any actor -> api: frames its inbox dropped (FramesRejected)
    senders.py    which role may send which message to which actor (no messages)
    vocabulary.py the lifecycle's words (EngineState, PauseMode, WakeTag), no messages

`ALL_MESSAGE_TYPES` is what the engine's codec registers.
"""

from trillium.actors.protocol import admin, execute, outputs, rejections, requests, supervision

ALL_MESSAGE_TYPES: tuple[type, ...] = (
    *requests.MESSAGES,
    *execute.MESSAGES,
    *outputs.MESSAGES,
    *supervision.MESSAGES,
    *admin.MESSAGES,
    *rejections.MESSAGES,
)
