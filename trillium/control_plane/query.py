"""Query-string arguments of the admin routes (vLLM puts its admin arguments there).

    @takes_query("level", "mode")        on a view: the query parameters it knows
    reject_unknown_query()               app.before_request: any other parameter is a 400 naming it
    query_fields(model, names)           those present, as `model`'s fields, coerced in pydantic's
                                         lax mode ("2" -> 2, "true" -> True, "keep" -> PauseMode.KEEP);
                                         a list field takes every value of a repeated parameter
                                         (?tags=weights&tags=kv_cache)
    with_query(body, names)              a parsed body with those fields from the query on top; a
                                         field given in both with different values is a 400

So `POST /sleep?level=2` means what it means in vLLM, `POST /sleep {"level": 2}`
what it means in Trillium, and `POST /sleep?lvl=2` is refused, not ignored.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

import pydantic
from quart import current_app, request

from trillium.control_plane.errors import bad_request

_ATTRIBUTE = "trillium_query_params"


def takes_query(*names: str):
    """Mark a view with the query parameters it understands (apply below the route decorator)."""

    def mark(view):
        setattr(view, _ATTRIBUTE, frozenset(names))
        return view

    return mark


async def reject_unknown_query() -> None:
    if request.endpoint is None or not request.args:
        return  # no route: the 404 / 405 says so
    view = current_app.view_functions.get(request.endpoint)
    known = getattr(view, _ATTRIBUTE, frozenset())
    unknown = sorted(set(request.args) - known)
    if unknown:
        takes = ", ".join(sorted(known)) or "none"
        raise bad_request(f"unknown query parameter {unknown[0]!r} for {request.method} {request.path} "
                          f"(it takes: {takes})", unknown[0])


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_list(arg) for arg in typing.get_args(annotation))
    return typing.get_origin(annotation) is list


def query_fields(model: type[pydantic.BaseModel], names: tuple[str, ...]) -> dict[str, Any]:
    """The query parameters among `names` that are present, validated as `model`'s fields."""
    values: dict[str, Any] = {}
    for name in names:
        if name not in request.args:
            continue
        field = model.model_fields[name]
        raw = request.args.getlist(name)
        annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        adapter = pydantic.TypeAdapter(annotation)
        try:
            values[name] = adapter.validate_python(raw if _is_list(field.annotation) else raw[-1], strict=False)
        except pydantic.ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            raise bad_request(f"{name} (query): {first['msg']}, got {raw if len(raw) > 1 else raw[0]!r}",
                              name) from None
    return values


def with_query(body: pydantic.BaseModel, names: tuple[str, ...]) -> Any:
    """`body` with the fields the query gives; a field in both with different values is a 400."""
    query = query_fields(type(body), names)
    for name, value in query.items():
        if name in body.model_fields_set and getattr(body, name) != value:
            raise bad_request(f"{name} is given in the query ({value!r}) and in the body "
                              f"({getattr(body, name)!r}); give it once", name)
    return body.model_copy(update=query) if query else body
