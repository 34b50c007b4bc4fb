"""Incremental detokenization and stop strings (the detokenizer's pure core).

`DetokenizerRegistry` is what the actor calls: TokenDeltas in,
RequestOutputs (and FinishRequest when a stop string ended requests) out.

Role: the detokenizer actor (DESIGN.md §2, data flow step 5) keeps one
`IncrementalDetokenizer` per running request. For each `RequestDelta` it calls
`update(new_token_ids)`; the returned `DetokenizerUpdate` becomes the text of
a `RequestOutputDelta` for the api, and when a stop string ends the request
(`finished` with a `stop_reason`) the actor also tells the scheduler
`FinishRequest` and forgets the request. When the scheduler ends the request
for another reason (EOS, stop token id, max_tokens, abort) the actor calls
`flush()` to get the text still held back. No trio, no zmq: plain calls.

State owned per request: a `tokenizers.decoders.DecodeStream` primed with the
end of the prompt, the generated token ids, the text not yet emitted (held
back because it may be the start of a stop string) and the emitted text.

Text definition (the same as vLLM v1's `FastIncrementalDetokenizer`): the
output text is what the generated tokens add to the decoded prompt,

    decode(prompt + generated) minus decode(prompt)

so the first tokens decode in context (a SentencePiece "▁a" after "Once upon"
is " a", not "a"; `skip_special_tokens` applies to the prompt too). As in
vLLM, only the last few prompt tokens are kept as context (the shortest
suffix of at least 4 tokens that decodes without U+FFFD), which gives the
same text for every tokenizer whose decoder is local (byte-level BPE,
SentencePiece/Metaspace, byte fallback). Two deliberate departures from a
plain full decode, both shared with vLLM:

- A prompt that ends in the middle of a UTF-8 character (byte-fallback
  tokens split across the prompt boundary) contributes its bytes to the first
  generated character: the output starts with the completed character.
- Llama's `ByteFallback` decoder turns a whole run of byte tokens into one
  U+FFFD per byte when any part of the run is invalid, which would rewrite
  text already sent. A stream cannot take text back, so it keeps what it sent
  and decodes the rest on its own (the library raises "Invalid prefix"; we
  restart the stream at the last emitted token, as vLLM does, but keep the
  not yet emitted tokens instead of dropping them).

`spaces_between_special_tokens=False` (with `skip_special_tokens=False`) is
vLLM's rule for fast tokenizers (vllm/v1/engine/detokenizer.py,
`FastIncrementalDetokenizer.decode_next`): an added token right after another
added token comes out as its bare content, without the separator the decoder
would put before it (WordPiece's " "). HF's own fast `decode` ignores the flag,
and byte-level / Metaspace decoders put nothing between added tokens, so for
the Llama family the text is the same either way.

NOTE on size (~430 lines): the incremental detokenizer and the registry that
owns one per request are the detokenizer actor's whole pure core, kept in
one module as the actor's other cores are.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import attrs
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from trillium.actors.protocol.outputs import (
    DetokenizeSpec,
    RequestDelta,
    RequestOutputDelta,
    RequestOutputs,
    TokenDeltas,
)
from trillium.actors.protocol.requests import FinishRequest
from trillium.actors.detokenizer.stop_matcher import StopMatcher

log = logging.getLogger(__name__)

# WHY 4..24: vLLM's choice. A few tokens of context fix decoders that look at
# neighbours (leading-space stripping); more only costs decode time.
_MIN_CONTEXT_TOKENS = 4
_MAX_CONTEXT_TOKENS = 24
_REPLACEMENT_CHAR = "\ufffd"
# The message DecodeStream.step raises (a bare Exception) when the decoder
# rewrote text it had already returned; see the module docstring.
_INVALID_PREFIX_MESSAGE = "Invalid prefix"


@attrs.frozen
class DetokenizerUpdate:
    """What one `update()` / `flush()` produced.

    text_delta: new text that is safe to send to the client (never a piece of
    a stop string that could still be cut, never half a character).
    finished: a stop string matched (from `update`), or the request ended
    (always True from `flush`). stop_reason: the stop string that matched.
    """

    text_delta: str
    finished: bool = False
    stop_reason: str | None = None


class _TokenTextStream:
    """Token ids in, final text chunks out: `DecodeStream` plus the state it
    does not expose.

    `DecodeStream.step` returns None while the text would end in an incomplete
    character and otherwise the text that the tokens since the last chunk
    added. What it cannot do, and this class adds: prime with a prompt that
    ends mid-character (its `ids=` argument would re-emit the whole prompt
    then), hand out the undecodable tail when the request ends (`flush`), and
    survive the "Invalid prefix" error. For that we keep every id fed and the
    index up to which the returned chunks account for them.

        ids:  [ context ............ | generated ........................ ]
                          ^prev_emit_end        ^emit_end               len
              tokens of the last chunk: [prev_emit_end, emit_end)
              pending (no text yet):    [emit_end, len)
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._stream_start = 0  # first id the current DecodeStream has seen
        self._prev_emit_end = 0
        self._emit_end = 0
        self._prime(prompt_token_ids)
        self._num_context_ids = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _prime(self, prompt_token_ids: Sequence[int]) -> None:
        tail = [int(i) for i in prompt_token_ids[-_MAX_CONTEXT_TOKENS:]]
        for num_ids in range(min(_MIN_CONTEXT_TOKENS, len(tail)), len(tail) + 1):
            context = tail[len(tail) - num_ids :]
            if _REPLACEMENT_CHAR not in self._decode(context):
                # Starts and ends on a character boundary: one call, and the
                # text it returns is the prompt's, so it is dropped.
                if context:
                    self._step(context)
                return
        # WHY one id at a time: the prompt ends mid-character (or holds a real
        # U+FFFD). Stepping leaves exactly the incomplete tail pending, so the
        # first generated character comes out whole and nothing else repeats.
        for token_id in tail:
            self._step([token_id])

    def _step(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        try:
            chunk = self._stream.step(self._tokenizer, new_ids)
        except Exception as exc:  # the library raises a bare Exception
            if not str(exc).startswith(_INVALID_PREFIX_MESSAGE):
                raise
            # WHY: the decoder rewrote text already sent (see module doc).
            # Restart at the last emitted token with the pending ids, so the
            # sent text stays and the rest is decoded on its own.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            self._stream_start = self._prev_emit_end = self._emit_end
            chunk = self._stream.step(self._tokenizer, self._ids[self._emit_end :])
        if chunk is None:
            return ""
        self._prev_emit_end, self._emit_end = self._emit_end, len(self._ids)
        return chunk

    def push(self, token_id: int) -> str:
        """Feed one generated id; return the text it completes (maybe "")."""
        return self._step([token_id])

    def flush(self) -> str:
        """Text of the pending generated ids as a full decode would give it
        (U+FFFD for a character that never completed)."""
        if len(self._ids) <= max(self._emit_end, self._num_context_ids):
            return ""  # nothing generated is pending (prompt bytes alone say nothing)
        # Context: the tokens of the last chunk (what DecodeStream itself
        # decodes against), at least a few, never before a restart.
        context_start = max(
            self._stream_start, min(self._prev_emit_end, self._emit_end - _MIN_CONTEXT_TOKENS)
        )
        context_end = max(self._emit_end, self._num_context_ids)
        context = self._ids[context_start:context_end]
        pending = self._ids[context_end:]
        self._prev_emit_end = self._emit_end = len(self._ids)
        context_text = self._decode(context)
        text = self._decode(context + pending)
        if text.startswith(context_text):
            return text[len(context_text) :]
        return self._decode(pending)  # the byte-fallback rewrite again: decode apart


class IncrementalDetokenizer:
    """Streaming text of one request, stop strings included.

    Idea: every generated id goes through the decode stream, which yields
    text only once characters are complete. After each id the new text is
    searched for stop strings (a match may start in earlier text); several
    ids in one `update` are checked one by one, so chunking never changes
    the result. Text is emitted up to the longest suffix that could still
    grow into a stop string (at most len(longest stop) - 1 characters, as
    vLLM v1 holds back), so a client never sees a piece of a stop string that
    is later cut.

    Which stop wins: the match that starts earliest in the text, then the one
    listed first (vLLM takes the first listed that matches). NOTE: a token
    whose text ends in an incomplete character yields nothing until the
    character completes (or `flush`), so a stop string inside that token's
    text is found on a later token; the text is the same, only
    `token_ids` is longer (vLLM and TGI behave alike).

    INVARIANT: with no stop string matched, the concatenation of every
    `text_delta` from `update` and `flush` equals decode(prompt + generated)
    minus decode(prompt) (module docstring for the two exceptions).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | StopMatcher = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        spaces_between_special_tokens: bool = True,
        added_tokens: Mapping[int, str] | None = None,
    ) -> None:
        """`tokenizer` is the Rust tokenizer (`tokenizers.Tokenizer`; a
        transformers fast tokenizer's `.backend_tokenizer`). `prompt_token_ids`
        may be a list or a numpy array. `stop`: the stop strings, or their
        `StopMatcher` (shared by the choices of one request). `min_tokens`: as
        in vLLM, stop strings are not checked until that many tokens were generated.
        `spaces_between_special_tokens`: see the module docstring; `added_tokens`
        (id -> content, `added_token_contents(tokenizer)` when None) is what it needs."""
        self._stream = _TokenTextStream(tokenizer, prompt_token_ids, skip_special_tokens)
        # id -> content of the added tokens whose separators are dropped; empty: nothing to drop.
        self._joined_added: Mapping[int, str] = {}
        if not (skip_special_tokens or spaces_between_special_tokens):
            self._joined_added = added_token_contents(tokenizer) if added_tokens is None else added_tokens
        self._last_was_added = False
        self._stops = stop if isinstance(stop, StopMatcher) else StopMatcher(stop)
        self._include_stop_str_in_output = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._token_ids: list[int] = []
        self._emitted_chunks: list[str] = []
        # Last characters already emitted: a stop string may start there when
        # include_stop_str_in_output (no hold-back then).
        self._emitted_tail = ""
        self._num_tail_chars = max(self._stops.max_len, 1) - 1
        self._unsent = ""
        self._finished = False

    @property
    def text(self) -> str:
        """All text so far: emitted plus held back; after a stop, the final text."""
        return "".join(self._emitted_chunks) + self._unsent

    @property
    def token_ids(self) -> Sequence[int]:
        """Generated ids so far (read only). After a stop string, ids that came
        after the one that completed it in the same update are not included."""
        return self._token_ids

    @property
    def finished(self) -> bool:
        return self._finished

    def update(
        self, new_token_ids: Sequence[int], *, stop_token_terminated: bool = False
    ) -> DetokenizerUpdate:
        """Detokenize new ids and check stop strings.

        `stop_token_terminated`: the last id is the EOS / stop token that ended
        the request; as in vLLM it is recorded but its text is left out unless
        include_stop_str_in_output. The caller still calls `flush()` then.
        """
        if self._finished:
            raise RuntimeError("update() after the request finished")
        ids = list(new_token_ids)
        silent_id = None
        if stop_token_terminated and ids and not self._include_stop_str_in_output:
            silent_id = ids.pop()
        for token_id in ids:
            self._token_ids.append(int(token_id))
            stop_update = self._add_text(self._next_text(int(token_id)))
            if stop_update is not None:
                return stop_update
        if silent_id is not None:
            self._token_ids.append(int(silent_id))
        return DetokenizerUpdate(text_delta=self._emit(self._hold_back()))

    def _next_text(self, token_id: int) -> str:
        chunk = self._stream.push(token_id)
        if not self._joined_added:
            return chunk
        content = self._joined_added.get(token_id)
        # NOTE: an added token decodes whole, so after one nothing is pending and
        # `chunk` is this token's text alone.
        if content is not None and self._last_was_added and chunk:
            chunk = content
        self._last_was_added = content is not None
        return chunk

    def flush(self) -> DetokenizerUpdate:
        """The request ended for a reason other than a stop string: decode the
        pending ids and return everything held back."""
        if self._finished:
            raise RuntimeError("flush() after the request finished")
        stop_update = self._add_text(self._stream.flush())
        if stop_update is not None:
            return stop_update
        self._finished = True
        return DetokenizerUpdate(text_delta=self._emit(0), finished=True)

    def _add_text(self, chunk: str) -> DetokenizerUpdate | None:
        """Append decoded text; on a stop string, finish and return the update."""
        if not chunk:
            return None
        search_text = self._emitted_tail + self._unsent
        search_from = len(search_text)
        search_text += chunk
        self._unsent += chunk
        if not self._stops or len(self._token_ids) <= self._min_tokens:
            return None
        match = self._stops.find(search_text, search_from)
        if match is None:
            return None
        index, stop = match
        end = index + len(stop) if self._include_stop_str_in_output else index
        # INVARIANT: end >= len(emitted_tail): emitted text never reaches a
        # stop string's start (hold-back) nor, when included, its end.
        self._unsent = search_text[len(self._emitted_tail) : end]
        self._finished = True
        return DetokenizerUpdate(text_delta=self._emit(0), finished=True, stop_reason=stop)

    def _hold_back(self) -> int:
        if not self._stops or self._include_stop_str_in_output:
            return 0  # nothing emitted is ever cut
        # The held suffix lies inside the unsent text: an earlier start would
        # have been held back by the previous update already.
        return self._stops.hold_back(self._unsent)

    def _emit(self, num_chars_held: int) -> str:
        num_chars_sent = len(self._unsent) - num_chars_held
        delta, self._unsent = self._unsent[:num_chars_sent], self._unsent[num_chars_sent:]
        if delta:
            self._emitted_chunks.append(delta)
            if self._num_tail_chars:
                self._emitted_tail = (self._emitted_tail + delta)[-self._num_tail_chars :]
        return delta


def added_token_contents(tokenizer: Tokenizer) -> dict[int, str]:
    """id -> content of every added token (special or not), as vLLM collects them."""
    return {token_id: token.content for token_id, token in tokenizer.get_added_tokens_decoder().items()}


class DetokenizerRegistry:
    """Request id -> incremental detokenizer; the actor's whole state.

    A request that a stop string finished may still receive tokens from a
    step already in flight; those are dropped until its final delta.

    The choices of an n > 1 request share one DetokenizeSpec, sent once with
    the first of their first deltas (scheduler/group_specs.py); it is kept,
    with its StopMatcher, until each choice's first delta has taken it."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._live: dict[str, IncrementalDetokenizer] = {}
        self._stopped: set[str] = set()  # finished by a stop string, engine not yet told
        self._added_tokens: dict[int, str] | None = None  # built for the first request that needs it
        # group id -> [spec, its StopMatcher, choices still to take it]
        self._groups: dict[str, list] = {}

    @property
    def num_groups(self) -> int:
        """Shared specs still waiting for a choice's first delta."""
        return len(self._groups)

    def _spec(self, delta: RequestDelta) -> tuple[DetokenizeSpec | None, StopMatcher | None]:
        """The spec of a choice's first delta and its matcher: its own, or its group's."""
        if delta.group_id is None:
            return delta.spec, None if delta.spec is None else StopMatcher(delta.spec.stop)
        if delta.spec is not None:
            entry = [delta.spec, StopMatcher(delta.spec.stop), delta.spec.num_choices]
            if entry[2] > 1:
                self._groups[delta.group_id] = entry
        else:
            entry = self._groups.get(delta.group_id)
            if entry is None:
                log.error("detokenizer: request %s names unknown group %s", delta.request_id, delta.group_id)
                return None, None
        entry[2] -= 1
        if entry[2] <= 0:
            self._groups.pop(delta.group_id, None)
        return entry[0], entry[1]

    def process(self, message: TokenDeltas) -> tuple[RequestOutputs, FinishRequest | None]:
        outputs: list[RequestOutputDelta] = []
        stopped: list[str] = []
        for delta in message.deltas:
            out = self._one(delta)
            if out is None:
                continue
            outputs.append(out)
            if out.finished and delta.finish_reason is None:
                stopped.append(delta.request_id)
        finish = FinishRequest(request_ids=tuple(stopped)) if stopped else None
        return RequestOutputs(deltas=tuple(outputs)), finish

    def _one(self, delta: RequestDelta) -> RequestOutputDelta | None:
        rid = delta.request_id
        detok = self._live.get(rid)
        if detok is None:
            if rid in self._stopped:
                if delta.finish_reason is not None:
                    self._stopped.discard(rid)
                return None  # tokens past a stop string
            spec, stops = self._spec(delta)
            if spec is None:
                # Rejected or aborted before its first token: no text to decode.
                if delta.finish_reason is None:
                    log.error("detokenizer: delta for unknown request %s", rid)
                    return None
                return RequestOutputDelta(
                    request_id=rid, text="", new_token_ids=(), finished=True,
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                    num_prompt_tokens=delta.num_prompt_tokens,
                )
            joins = not (spec.skip_special_tokens or spec.spaces_between_special_tokens)
            if joins and self._added_tokens is None:
                self._added_tokens = added_token_contents(self._tokenizer)
            detok = IncrementalDetokenizer(
                self._tokenizer, spec.prompt_token_ids,
                skip_special_tokens=spec.skip_special_tokens, stop=stops,
                include_stop_str_in_output=spec.include_stop_str_in_output, min_tokens=spec.min_tokens,
                spaces_between_special_tokens=spec.spaces_between_special_tokens,
                added_tokens=self._added_tokens if joins else None,
            )
            self._live[rid] = detok
        before = len(detok.token_ids)
        # The scheduler itself finishes with "stop" only on EOS or a stop token id.
        update = detok.update(list(delta.new_token_ids), stop_token_terminated=delta.finish_reason == "stop")
        text = update.text_delta
        finished, finish_reason, stop_reason = False, None, None
        if update.finished:
            finished, finish_reason, stop_reason = True, "stop", update.stop_reason
        elif delta.finish_reason is not None:
            text += detok.flush().text_delta
            finished, finish_reason, stop_reason = True, delta.finish_reason, delta.stop_reason
        token_ids = tuple(detok.token_ids[before:])
        if finished:
            del self._live[rid]
            if delta.finish_reason is None:
                self._stopped.add(rid)
        return RequestOutputDelta(
            request_id=rid, text=text, new_token_ids=token_ids, finished=finished,
            finish_reason=finish_reason, stop_reason=stop_reason,
            logprobs=delta.logprobs[: len(token_ids)] if delta.logprobs else (),
            prompt_logprobs=delta.prompt_logprobs,
            num_prompt_tokens=delta.num_prompt_tokens, num_cached_tokens=delta.num_cached_tokens,
            queue_time_s=delta.queue_time_s, pooled=delta.pooled,
        )
