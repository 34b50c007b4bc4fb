"""Structured outputs: what a constrained request asks for, and its xgrammar grammar.

Role: `StructuredOutputsParams` is the one request-level description of a
constraint (vLLM's field names, vllm/sampling_params.py
`StructuredOutputsParams`); it rides inside `SamplingParams.structured_outputs`
from the api through the scheduler to the executor. `build_grammar` turns it
into an `xgrammar.Grammar` (no tokenizer needed); `validate_structured_outputs`
calls it at the edge so a schema, regex or grammar xgrammar cannot take is a
ValueError naming the problem (a 400), as vLLM's `validate_xgrammar_grammar`
does (vllm/v1/structured_output/backend_xgrammar.py: it also only builds the
grammar, it does not compile it).

Where the work happens (the design):

    api        validate_structured_outputs: build the Grammar (cached by key)
               -> 400 naming the problem; the request is sent only if it builds
    scheduler  scheduler/grammar_gate.py: a constrained request waits in the
               queue (skipped, never blocking the others) until the executor
               reported its grammar compiled; the compile order rides in the
               next ExecuteBatch (`compile_grammars`), the answer in a
               BatchResult (`grammars_ready` / `grammars_failed`); with nothing
               else to run the scheduler sends an empty step that waits briefly
               for a compile, as it does for disk reads
    executor   executor/grammar.py: compiles on a thread pool against the one
               TokenizerInfo built from the served tokenizer (the model's
               vocab_size, which may exceed the tokenizer's), caches by key;
               each sequence gets its own GrammarMatcher in its SamplingState
               (n > 1: one each; preemption keeps the state, so nothing is
               replayed); the sampler ORs nothing and ANDs one bitmask per step
               into the constrained rows before sampling

WHY compile in the executor: the compiled grammar (its token-mask cache) is
large and lives where the logits are; shipping it would cost more than
compiling. WHY the scheduler waits and the executor never does: a cold
compile (tens to hundreds of ms on a large vocabulary) must not stall a step
that serves other requests.

`activate_after`: the constraint is not applied until this token sequence
appears in the generated tokens (a reasoning model's `</think>`), so only the
answer is constrained. It is not part of the grammar's cache key.

NOTE on truncation: the grammar decides which tokens may come next, not how
many; a request that hits max_tokens before its grammar completes returns the
valid prefix, which may not parse (finish_reason "length"), as in vLLM.
JSON takes xgrammar's fixed layout (`{"a": 1, "b": [1, 2]}`, as vLLM with
`disable_any_whitespace`): WHY: with any whitespace allowed, a model that
likes newlines spends its whole budget on them inside valid JSON.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import attrs

_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _json_text(value: Any) -> str | None:
    """A schema or structural tag given as a dict (or pydantic's JSON) -> its JSON text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value)  # WHY not sorted: properties are generated in schema order
    raise TypeError(f"expected a JSON string or an object, got {type(value).__name__}")


def _str_tuple(value: Any) -> tuple[str, ...] | None:
    if value is None or isinstance(value, tuple):
        return value
    return tuple(value)


def _int_tuple(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(int(t) for t in value)


@attrs.frozen
class StructuredOutputsParams:
    """One constraint on a request's output (exactly one kind set).

    json            a JSON schema (JSON text, or a dict: stored as its JSON text)
    regex           a regular expression the whole output matches
    choice          the output is exactly one of these strings
    grammar         an EBNF / GBNF grammar (root rule `root`)
    json_object     any JSON object
    structural_tag  vLLM's structural tag (JSON text or dict): either
                    {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
                    or xgrammar's {"type": "structural_tag", "format": {...}}
    whitespace_pattern  JSON only: None (one space after , and :) or "" (none)
    activate_after  internal: token ids after which the constraint starts
    """

    json: str | None = attrs.field(default=None, converter=_json_text)
    regex: str | None = None
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_str_tuple)
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = attrs.field(default=None, converter=_json_text)
    whitespace_pattern: str | None = None
    activate_after: tuple[int, ...] | None = attrs.field(default=None, converter=_int_tuple)

    def __attrs_post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs: exactly one of {', '.join(_KINDS)} must be set (got {what})")
        if self.whitespace_pattern is not None and self.kind not in ("json", "json_object"):
            raise ValueError("structured_outputs.whitespace_pattern: only applies to json and json_object")
        if self.activate_after is not None and not self.activate_after:
            raise ValueError("structured_outputs.activate_after: must not be empty")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of json, regex, choice, grammar, json_object, structural_tag."""
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> str:
        """The grammar's identity, for compile caches (activate_after excluded)."""
        return json.dumps([self.kind, getattr(self, self.kind), self.whitespace_pattern])


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    # WHY json.dumps: an EBNF string literal takes JSON's escapes (quotes, backslashes, \n).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _json_options(whitespace_pattern: str | None) -> dict[str, Any]:
    if whitespace_pattern is None:
        return dict(any_whitespace=False)  # xgrammar's layout: {"a": 1, "b": [1, 2]}
    if whitespace_pattern == "":
        return dict(any_whitespace=False, separators=(",", ":"))
    raise ValueError(
        f"structured_outputs.whitespace_pattern: the xgrammar backend takes only \"\" (no whitespace) or "
        f"null (one space after , and :), got {whitespace_pattern!r}"
    )


# Character classes of xgrammar 0.2.9's JSON strings, and what they become.
# WHY: a string with minLength / maxLength is lowered to a class that lets raw
# control characters in (invalid JSON: json.loads and pydantic refuse it), and
# every string class lets UTF-8-encoded surrogates in (bytes a decoder turns
# into U+FFFD, three per surrogate, so a bounded string comes out too long).
_STRING_CLASS_FIXES = (
    (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\ud800-\udfff]'),  # length-bounded (escapes stay out)
    (r'[^\0-\x1f\"\\\r\n]', r'[^\0-\x1f\"\\\ud800-\udfff]'),  # unbounded
)


def _json_grammar(schema: str, whitespace_pattern: str | None):
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, **_json_options(whitespace_pattern))
    text = fixed = str(grammar)
    for old, new in _STRING_CLASS_FIXES:
        fixed = fixed.replace(old, new)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def _structural_tag(text: str):
    import xgrammar as xgr

    tag = json.loads(text)
    if isinstance(tag, dict) and "structures" in tag:
        # vLLM's older form (backend_xgrammar.py falls back to xgrammar's legacy API).
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", ())))
    return xgr.Grammar.from_structural_tag(text)


def _build(params: StructuredOutputsParams):
    import xgrammar as xgr

    kind = params.kind
    if kind == "json":
        return _json_grammar(params.json, params.whitespace_pattern)
    if kind == "json_object":
        # vLLM: {"type": "object"}, so the answer is an object, not any JSON value.
        return _json_grammar('{"type": "object"}', params.whitespace_pattern)
    if kind == "regex":
        if "\x00" in params.regex:
            raise ValueError("must not contain a NUL character")
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        if not params.choice or not all(isinstance(c, str) and c for c in params.choice):
            raise ValueError("must be a non-empty list of non-empty strings")
        return xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(params.grammar)
    return _structural_tag(params.structural_tag)


def params_from_key(key: str) -> StructuredOutputsParams:
    """The inverse of `StructuredOutputsParams.key` (activate_after is not in it)."""
    kind, value, whitespace_pattern = json.loads(key)
    return StructuredOutputsParams(**{kind: value}, whitespace_pattern=whitespace_pattern)


@functools.lru_cache(maxsize=256)
def _cached_grammar(key: str):
    # WHY keyed by `key` alone: two requests with the same constraint but a
    # different activate_after share one grammar.
    return _build(params_from_key(key))


def build_grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar for `params`; ValueError naming the field and xgrammar's reason."""
    try:
        return _cached_grammar(params.key)
    except ValueError as exc:
        if str(exc).startswith("structured_outputs"):
            raise
        raise ValueError(f"structured_outputs.{params.kind}: {exc}") from None
    except Exception as exc:  # xgrammar raises RuntimeError / its own errors with the C++ message
        # WHY: xgrammar prefixes "[hh:mm:ss] /project/cpp/file.cc:123: "; the client needs the reason only.
        message = _XGRAMMAR_PREFIX.sub("", " ".join(str(exc).split()))
        raise ValueError(f"structured_outputs.{params.kind}: xgrammar cannot use it: {message}") from None


def validate_structured_outputs(params: StructuredOutputsParams | None) -> None:
    """Raise ValueError (a 400 at the edge) if xgrammar cannot build `params`' grammar.

    Cheap after the first call for the same constraint (an LRU of built grammars).
    """
    if params is not None:
        build_grammar(params)


__all__ = ["StructuredOutputsParams", "build_grammar", "params_from_key",
           "validate_structured_outputs"]
