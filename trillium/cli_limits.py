"""The `trillium serve` flags of the server's bounds: request caps, queue, body, connections.

`add_limit_arguments(parser)` adds the "limits" group; `request_limits(args)`
builds the data plane's `RequestLimits` (data_plane/limits.py) from them.
Kept apart from cli.py so the flags, their defaults and their help live
next to each other in one short module (README "Limits" lists them).
"""

from __future__ import annotations

import argparse

from trillium.data_plane.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_LOGIT_BIAS,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_STOP_STRING_CHARS,
    DEFAULT_MAX_STOP_STRINGS,
    PROMPT_CHARS_PER_TOKEN,
    QUEUE_DEPTH_FACTOR,
    RequestLimits,
)
from trillium.data_plane.protocol import MAX_N


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits (each refusal names its flag; README: Limits)")
    add = group.add_argument
    add("--max-queued-requests", type=_non_negative, default=None,
        help="engine requests (prompts x n of every HTTP request) admitted and not finished, beyond which a new "
             f"request gets 503 + Retry-After (default: {QUEUE_DEPTH_FACTOR} x min(--max-num-seqs, KV cache "
             "blocks); 0: no limit)")
    add("--max-queue-time-s", type=float, default=0.0,
        help="seconds a request may wait in the scheduler's queue before it is dropped with 503 + Retry-After "
             "(default 0: no limit); a preempted request that already ran is never dropped")
    add("--max-prompts-per-request", type=_non_negative, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        help=f"prompts in one /v1/completions or /generate request (default {DEFAULT_MAX_PROMPTS_PER_REQUEST})")
    add("--max-n", type=int, default=MAX_N,
        help=f"choices per prompt, n (default and most: {MAX_N}, OpenAI's)")
    add("--max-stop-strings", type=_non_negative, default=DEFAULT_MAX_STOP_STRINGS,
        help=f"stop strings in one request (default {DEFAULT_MAX_STOP_STRINGS})")
    add("--max-stop-string-chars", type=_non_negative, default=DEFAULT_MAX_STOP_STRING_CHARS,
        help="characters of the longest stop string; streamed text is held back up to this length "
             f"(default {DEFAULT_MAX_STOP_STRING_CHARS})")
    add("--max-logit-bias", type=_non_negative, default=DEFAULT_MAX_LOGIT_BIAS,
        help=f"entries in one request's logit_bias (default {DEFAULT_MAX_LOGIT_BIAS})")
    add("--max-prompt-chars", type=_non_negative, default=0,
        help="characters of one prompt text (chat: of all messages) accepted for tokenizing; longer is a 400 "
             f"before the tokenizer runs (default 0: {PROMPT_CHARS_PER_TOKEN} x --max-model-len)")
    add("--max-request-body-bytes", type=_non_negative, default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body on the data port; larger is a 413 (default {DEFAULT_MAX_BODY_BYTES >> 20} MiB)")
    add("--max-concurrent-connections", type=_non_negative, default=DEFAULT_MAX_CONNECTIONS,
        help="requests the data port serves at once (one per HTTP/1.1 connection; idle keep-alive connections "
             f"close after 5 s); one more gets 503 and a closed connection (default {DEFAULT_MAX_CONNECTIONS}; "
             "0: no limit)")
    add("--metrics-without-auth", action="store_true",
        help="with --api-key, still serve /metrics on the data port without the key (for Prometheus scrapers)")


def request_limits(args: argparse.Namespace) -> RequestLimits:
    try:
        return RequestLimits(
            max_prompts_per_request=args.max_prompts_per_request, max_n=args.max_n,
            max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars,
            max_logit_bias=args.max_logit_bias, max_prompt_chars=args.max_prompt_chars,
            max_body_bytes=args.max_request_body_bytes, max_connections=args.max_concurrent_connections,
            metrics_without_auth=args.metrics_without_auth,
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
