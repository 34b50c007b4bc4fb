"""Bounded work per HTTP request: the data plane's caps and their 400s.

`RequestLimits` is part of the frozen `DataPlaneEngine` bundle (context.py),
built once from the `trillium serve` flags. The routes call it at two
points, so every cap is checked before the work it bounds:

    before tokenizing   check_num_prompts(n, param)     prompts in one request
                        check_text(text, param)         characters of one text (the tokenizer runner;
                        check_num_chars(n, param)        chat: of all messages)
                        check_num_tokens(ids, param)    length of a token-id list, before walking it
    at admission        check_params(params, prefix)    n, stop strings (count, length), logit_bias size
                        num_engine_requests(params)     what admission charges: sum of n over the prompts

Every refusal is a 400 in OpenAI's error shape whose `param` names the
request field and whose message names the flag that sets the cap, so an
operator reading a client's error knows which knob it hit.

Defaults (README "Limits" has the table): vLLM bounds none of these but
logprobs (`--max-logprobs` 20, here fixed in SamplingParams.validate) and
VLLM_MAX_NUM_BAD_WORDS (128); OpenAI's API bounds n at 128 (protocol.MAX_N).
Ours are chosen to be far above what a legitimate client sends and far
below what stalls the engine (the measurements in ISSUE 16: 10,000 stop
strings x n=4 cost 24 ms of detokenizer time per token before the matcher
of actors/detokenizer/stop_matcher.py).

No state, no I/O: plain checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from trillium.data_plane.errors import bad_request
from trillium.data_plane.protocol import MAX_N
from trillium.sampling_params import SamplingParams

DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_STRING_CHARS = 256
DEFAULT_MAX_LOGIT_BIAS = 1024
# WHY 16: byte-level BPE and SentencePiece vocabularies average 3-5 characters per
# token on text and code; 16 leaves room for long whitespace or repeated runs while
# refusing a 15 MB text for a 2k-token model before the tokenizer ever sees it.
PROMPT_CHARS_PER_TOKEN = 16
DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # Quart's default is 16 MiB
DEFAULT_MAX_CONNECTIONS = 2048
# WHY 4: the engine runs at most min(max_num_seqs, KV blocks) requests at once;
# four times that keeps the next batches queued without an unbounded backlog.
QUEUE_DEPTH_FACTOR = 4


def default_max_queued_requests(max_num_seqs: int, num_kv_blocks: int) -> int:
    """--max-queued-requests when not given, in engine requests: QUEUE_DEPTH_FACTOR x
    the requests the engine can run at once (each running request holds at least one
    KV block, so the KV cache bounds them as well as max_num_seqs)."""
    return QUEUE_DEPTH_FACTOR * max(1, min(max_num_seqs, num_kv_blocks))


def _too_many(param: str, what: str, num: int, limit: int, flag: str):
    return bad_request(f"{param}: {num} {what} exceed this server's limit of {limit} ({flag})", param)


@attrs.frozen
class RequestLimits:
    """The caps of one data plane. `max_prompt_chars` 0 means PROMPT_CHARS_PER_TOKEN x
    max_model_len (resolved by `for_model`)."""

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # --max-prompts-per-request
    max_n: int = MAX_N  # --max-n
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS  # --max-stop-strings
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS  # --max-stop-string-chars
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS  # --max-logit-bias
    max_prompt_chars: int = 0  # --max-prompt-chars
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # --max-request-body-bytes
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # --max-concurrent-connections
    metrics_without_auth: bool = False  # --metrics-without-auth

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if field.type != "bool" and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{field.name}: must be a non-negative integer, got {value!r}")
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"--max-n must be in [1, {MAX_N}] (OpenAI's bound), got {self.max_n}")

    def for_model(self, max_model_len: int) -> "RequestLimits":
        if self.max_prompt_chars:
            return self
        return attrs.evolve(self, max_prompt_chars=PROMPT_CHARS_PER_TOKEN * max_model_len)

    # -- before tokenizing --------------------------------------------------

    def check_num_prompts(self, num_prompts: int, param: str = "prompt") -> None:
        if num_prompts > self.max_prompts_per_request:
            raise _too_many(param, "prompts", num_prompts, self.max_prompts_per_request, "--max-prompts-per-request")

    def check_text(self, text: str, param: str = "prompt") -> None:
        self.check_num_chars(len(text), param)

    def check_num_chars(self, num_chars: int, param: str = "prompt") -> None:
        if self.max_prompt_chars and num_chars > self.max_prompt_chars:
            raise _too_many(param, "characters", num_chars, self.max_prompt_chars, "--max-prompt-chars")

    def check_num_tokens(self, token_ids: Sequence[int], max_model_len: int, param: str = "prompt") -> None:
        """A token-id list longer than the context is refused by its length alone."""
        if len(token_ids) > max_model_len:
            raise bad_request(f"{param}: {len(token_ids)} tokens exceed the model's context of {max_model_len}",
                              param)

    # -- at admission -------------------------------------------------------

    def check_params(self, params: SamplingParams, prefix: str = "") -> None:
        """n, stop strings and logit_bias of one prompt's params (`prefix`: the wire's
        path to them, e.g. "sampling_params." for SGLang's /generate)."""
        if params.n > self.max_n:
            raise _too_many(f"{prefix}n", "choices", params.n, self.max_n, "--max-n")
        if len(params.stop) > self.max_stop_strings:
            raise _too_many(f"{prefix}stop", "stop strings", len(params.stop), self.max_stop_strings,
                            "--max-stop-strings")
        longest = max((len(s) for s in params.stop), default=0)
        if longest > self.max_stop_string_chars:
            raise bad_request(f"{prefix}stop: a stop string of {longest} characters exceeds this server's limit "
                              f"of {self.max_stop_string_chars} (--max-stop-string-chars)", f"{prefix}stop")
        num_bias = len(params.logit_bias or ())
        if num_bias > self.max_logit_bias:
            raise _too_many(f"{prefix}logit_bias", "entries", num_bias, self.max_logit_bias, "--max-logit-bias")


def num_engine_requests(params: Sequence[SamplingParams]) -> int:
    """Engine requests an HTTP request becomes: one per prompt and choice."""
    return sum(p.n for p in params)


__all__ = ["RequestLimits", "default_max_queued_requests", "num_engine_requests"]
