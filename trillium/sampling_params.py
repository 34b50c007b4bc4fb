"""Per-request sampling parameters, validated once at the edge.

`SamplingParams` is a frozen attrs class: it crosses the api → scheduler →
executor boundaries inside protocol messages, so it holds only plain values.
`validate(vocab_size, max_model_len)` raises `ValueError` naming the bad
parameter; the offline API and the HTTP layer call it before a request ever
reaches the engine.
"""

from __future__ import annotations

import attrs

from trillium.structured_outputs import StructuredOutputsParams, validate_structured_outputs


# The largest stream interval a request (stream_interval) or the server (--stream-interval) may
# set. WHY a bound: the tokens held for a chunk travel as one message, and the detokenizer's work on
# a message grows with the square of its text.
MAX_STREAM_INTERVAL = 1024


@attrs.frozen
class SamplingParams:
    """What to sample and when to stop, vLLM's names and defaults.

    temperature == 0 means greedy. top_k <= 0 (or -1) means off, top_p == 1
    and min_p == 0 mean off. Penalties follow vLLM: presence/frequency are
    additive over generated tokens, repetition is multiplicative over prompt
    and generated tokens (1.0 = off).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # False (with skip_special_tokens False): consecutive added tokens come out
    # without the separator a decoder may put between them (vLLM's fast detokenizer).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constraints, applied by the executor's per-request logits processors
    # (actors/executor/logits_processors.py): only these ids may be sampled
    # (None: any), and token sequences that must never be completed (the api
    # tokenizes vLLM's `bad_words` strings into them).
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # A grammar the output must follow (trillium/structured_outputs.py): JSON
    # schema, regex, choice, EBNF, any JSON object or a structural tag.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's thinking_token_budget: at most this many tokens inside the
    # thinking, then its end is forced (executor/logits_processors.py
    # ThinkingBudget). The delimiters are token sequences the api fills from
    # the reasoning parser's `<think>` / `</think>` (trillium.LLM from the
    # tokenizer's own tokens of those names).
    thinking_token_budget: int | None = None
    think_start_token_ids: tuple[int, ...] = ()
    think_end_token_ids: tuple[int, ...] = ()
    # False: this request never gets speculative drafts when the server speculates
    # (--speculative-config); its output is the same either way, only the speed differs.
    speculative: bool = True
    # Pooling models only (trillium/pooling): the request's pooling task, vLLM's names (embed |
    # classify | token_embed | token_classify); None: the server's default. The pooling routes
    # set it; the executor's pooling head reads it, and token tasks skip prefix-cache reads.
    pooling_task: str | None = None
    # Output pacing (never changes what is generated). `stream_interval`: a streamed chunk waits
    # for this many new tokens after the first (SGLang's and vLLM's per-request field; as vLLM,
    # at least the server's --stream-interval). `final_only`: nobody reads the output before
    # the request ends (vLLM's output_kind=FINAL_ONLY; the api sets it for `stream: false`,
    # trillium.LLM for every request), so the scheduler sends its first token, then chunks of 50
    # (SGLang's rule for unstreamed requests), unless it has stop strings (matched downstream,
    # in the detokenizer).
    stream_interval: int | None = None
    final_only: bool = False

    def __attrs_post_init__(self) -> None:
        # WHY: callers pass lists (JSON, vLLM habits); store tuples so the
        # object stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(
                self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()}
            )
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        for name in ("think_start_token_ids", "think_end_token_ids"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        words = self.bad_words_token_ids
        if not (isinstance(words, tuple) and all(isinstance(w, tuple) for w in words)):
            object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in words))

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first invalid parameter."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"invalid sampling parameter {name!r}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not (self.temperature >= 0.0):
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            bad("top_k", f"must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not (self.repetition_penalty > 0.0):
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.pooling_task not in (None, "embed", "classify", "token_embed", "token_classify"):
            bad("pooling_task", f"must be embed, classify, token_embed or token_classify, got {self.pooling_task!r}")
        interval = self.stream_interval
        if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool)
                                     or not 1 <= interval <= MAX_STREAM_INTERVAL):
            bad("stream_interval", f"must be an integer in [1, {MAX_STREAM_INTERVAL}], got {interval!r}")
        if not isinstance(self.final_only, bool):
            bad("final_only", f"must be true or false, got {self.final_only!r}")
        if not isinstance(self.speculative, bool):
            bad("speculative", f"must be true or false, got {self.speculative!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0 or value > 20):
                bad(name, f"must be an integer in [0, 20], got {value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "must not be empty")  # vLLM: nothing could be sampled
        if any(not word for word in self.bad_words_token_ids):
            bad("bad_words", "every entry must tokenize to at least one token")
        validate_structured_outputs(self.structured_outputs)  # ValueError naming the field
        if self.thinking_token_budget is not None:
            budget = self.thinking_token_budget
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                bad("thinking_token_budget", f"must be a non-negative integer, got {budget!r}")
            if not self.think_start_token_ids or not self.think_end_token_ids:
                bad("thinking_token_budget", "needs the model's start and end of thinking as tokens "
                    "(think_start_token_ids / think_end_token_ids; the server fills them with --reasoning-parser)")
        if vocab_size is not None:
            for tid in self.stop_token_ids:
                if not (0 <= tid < vocab_size):
                    bad("stop_token_ids", f"token id {tid} outside the vocabulary [0, {vocab_size})")
            for name, ids in (("allowed_token_ids", self.allowed_token_ids or ()),
                              ("bad_words", [t for word in self.bad_words_token_ids for t in word]),
                              ("think_start_token_ids", self.think_start_token_ids),
                              ("think_end_token_ids", self.think_end_token_ids)):
                for tid in ids:
                    if not (0 <= tid < vocab_size):
                        bad(name, f"token id {tid} outside the vocabulary [0, {vocab_size})")
            for tid, bias in (self.logit_bias or {}).items():
                if not (0 <= tid < vocab_size):
                    bad("logit_bias", f"token id {tid} outside the vocabulary [0, {vocab_size})")
                if not (-100.0 <= bias <= 100.0):
                    bad("logit_bias", f"bias for token {tid} must be in [-100, 100], got {bias}")
