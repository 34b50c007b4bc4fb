"""Executor side of structured outputs: grammar compiles and per-sequence matchers.

Role (the design is in trillium/structured_outputs.py):

    GrammarCompiler   one per executor. With the first grammar it builds
                      xgrammar's TokenizerInfo, once, from the served tokenizer,
                      on its compile thread (vocab_size = the model's, which may
                      exceed the tokenizer's: the extra ids are never allowed). `submit`
                      (keys from ExecuteBatch.compile_grammars) compiles on a
                      thread pool; `completions` reports the keys done since
                      the last call, for BatchResult. Compiled grammars are
                      cached by key (LRU); an evicted key is reported so the
                      scheduler compiles it again before admitting its next
                      request.
    GrammarConstraint one per sequence, in its SamplingState: an xgrammar
                      GrammarMatcher over the compiled grammar. `advance`
                      feeds it the sequence's new output tokens (lazily, before
                      each mask, so a resumed sequence needs no replay);
                      `fill` writes its row of the step's token bitmask.
    apply_grammar_bitmask  the sampler's stage: one bitmask for the step's
                      constrained rows, applied in place to their logits.

State: the compiler owns the TokenizerInfo, the xgrammar compiler, the
futures of pending compiles and the LRU of finished ones; a constraint owns
its matcher, how many output tokens it has consumed and whether its
`activate_after` trigger has appeared.

NOTE: the matcher's stop tokens are the request's EOS ids (the ones the
scheduler stops on), so a complete grammar allows exactly the tokens that
finish the request with finish_reason "stop".
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch

from trillium.structured_outputs import StructuredOutputsParams, build_grammar, params_from_key

log = logging.getLogger(__name__)

# Compiled grammars kept per executor (each holds a token-mask cache: up to a
# few MB on a 128k vocabulary).
MAX_CACHED_GRAMMARS = 128
_COMPILE_WORKERS = 2


class GrammarCompiler:
    """Compiles grammars off the step's path; see the module docstring."""

    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="trillium-grammar")
        # WHY lazy, on the pool: loading the tokenizer and building TokenizerInfo
        # takes a while on a large vocabulary; it never runs on the step's path,
        # and engines that never see a grammar never pay for it.
        self._xgr_compiler: Future | None = None
        self._pending: dict[str, Future] = {}
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._evicted: list[str] = []

    @staticmethod
    def _make_compiler(tokenizer_path: str, vocab_size: int):
        import xgrammar as xgr

        from trillium.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids) or None
        )
        return xgr.GrammarCompiler(info, max_threads=_COMPILE_WORKERS, cache_enabled=False)

    def _compile(self, key: str):
        compiler = self._xgr_compiler.result()
        return compiler.compile_grammar(build_grammar(params_from_key(key)))

    def submit(self, keys: Sequence[str]) -> None:
        """Start compiling each key not already compiled or compiling."""
        if keys and self._xgr_compiler is None:
            self._xgr_compiler = self._pool.submit(self._make_compiler, self.tokenizer_path, self.vocab_size)
        for key in keys:
            if key in self._compiled:
                self._compiled.move_to_end(key)
            elif key not in self._pending:
                self._pending[key] = self._pool.submit(self._compile, key)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def completions(self, timeout_s: float = 0.0) -> dict:
        """BatchResult's grammar fields: keys compiled, failed (key -> reason) and
        evicted since the last call; waits up to `timeout_s` for one to finish.
        {} when there is nothing to report (the common step)."""
        if not self._pending and not self._evicted:
            return {}
        if timeout_s > 0 and self._pending:
            wait_futures(list(self._pending.values()), timeout=timeout_s, return_when="FIRST_COMPLETED")
        ready: list[str] = []
        failed: dict[str, str] = {}
        for key, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            try:
                self._store(key, future.result())
                ready.append(key)
            except Exception as exc:  # a grammar the api's check let through, or no tokenizer
                log.warning("grammar compile failed: %s", exc)
                failed[key] = str(exc)
        evicted, self._evicted = [k for k in self._evicted if k not in ready], []
        return dict(grammars_ready=tuple(ready), grammars_failed=failed, grammars_evicted=tuple(evicted))

    def _store(self, key: str, compiled) -> None:
        self._compiled[key] = compiled
        while len(self._compiled) > MAX_CACHED_GRAMMARS:
            old, _ = self._compiled.popitem(last=False)
            self._evicted.append(old)

    def compiled(self, key: str):
        """The compiled grammar of `key`. The scheduler admits a request only
        after its key was reported ready; if it is gone anyway, compile here
        (a stall of this step, logged)."""
        found = self._compiled.get(key)
        if found is not None:
            self._compiled.move_to_end(key)
            return found
        log.warning("grammar %.80s was not compiled ahead; compiling on the step's path", key)
        self.submit([key])
        compiled = self._pending.pop(key).result()
        self._store(key, compiled)
        return compiled

    def constraint(self, params: StructuredOutputsParams, eos_token_ids: Sequence[int]) -> "GrammarConstraint":
        return GrammarConstraint(self.compiled(params.key), eos_token_ids, params.activate_after)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarConstraint:
    """One sequence's matcher; `advance` before `fill` each step."""

    __slots__ = ("matcher", "stop_token_ids", "trigger", "active", "num_consumed", "failed")

    def __init__(self, compiled, eos_token_ids: Sequence[int], activate_after: Sequence[int] | None) -> None:
        import xgrammar as xgr

        self.stop_token_ids = tuple(int(t) for t in eos_token_ids)
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(self.stop_token_ids) or None)
        self.trigger = tuple(activate_after) if activate_after else None
        self.active = self.trigger is None
        self.num_consumed = 0  # output tokens looked at (fed to the matcher once active)
        self.failed = False

    def advance(self, output_token_ids: Sequence[int]) -> None:
        """Feed the output tokens generated since the last call."""
        while self.num_consumed < len(output_token_ids):
            token = int(output_token_ids[self.num_consumed])
            self.num_consumed += 1
            if not self.active:
                n = len(self.trigger)
                if self.num_consumed >= n and tuple(output_token_ids[self.num_consumed - n:self.num_consumed]) \
                        == self.trigger:
                    self.active = True
                continue
            if self.failed or self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(token):
                # Only when every allowed token was also banned by another
                # constraint (allowed_token_ids, bad_words): stop masking.
                log.warning("grammar matcher rejected token %d; the constraint is dropped", token)
                self.failed = True

    @property
    def masks(self) -> bool:
        if not self.active or self.failed:
            return False
        return bool(self.stop_token_ids) or not self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)
            return
        # The grammar ended with a stop token the request did not stop on
        # (ignore_eos): only stop tokens may follow, as after any complete grammar.
        # NOTE: xgrammar refuses to fill a mask for a terminated matcher.
        bitmask[row] = 0
        for token in self.stop_token_ids:
            word, bit = divmod(token, 32)
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32 bits


def apply_grammar_bitmask(logits: torch.Tensor, constraints: Sequence[GrammarConstraint | None],
                          outputs: Sequence[Sequence[int]]) -> None:
    """Mask, in place, every token row i's grammar does not allow next (rows
    without an active constraint are untouched)."""
    rows = []
    for i, (constraint, output) in enumerate(zip(constraints, outputs)):
        if constraint is not None:
            constraint.advance(output)
            if constraint.masks:
                rows.append(i)
    if not rows:
        return
    import xgrammar as xgr

    vocab_size = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab_size)
    for i in rows:
        constraints[i].fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=vocab_size, indices=rows)


__all__ = ["GrammarCompiler", "GrammarConstraint", "MAX_CACHED_GRAMMARS", "apply_grammar_bitmask"]
