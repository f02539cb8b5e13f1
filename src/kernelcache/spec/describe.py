"""A pydantic error as one line a person can act on: the camelCase field path, what was
expected (a pattern's hint, not the regex), and for an unknown field the name it was likely
meant to be, looked up in the model the error is under."""

from __future__ import annotations

import difflib
import re
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails

from kernelcache.spec.common import PATTERN_HINTS


def format_loc(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", item):
            parts.append(f".{item}" if parts else item)
        else:
            parts.append(f'["{item}"]')  # a map key such as nvidia.com/gpu.product
    return "".join(parts)


def describe(error: ErrorDetails, root: type[BaseModel]) -> tuple[str, str]:
    """The camelCase field path and a short explanation of one pydantic error."""
    ctx = error.get("ctx", {})
    path = format_loc(error["loc"])
    if error["type"] == "spec_rule":
        field = ctx["field"]
        path = f"{path}.{field}" if path and field else path or field
        return path, error["msg"]
    got = error.get("input")
    shown = f", got {got!r:.60}" if isinstance(got, (str, int, float)) else ""
    if error["type"] == "missing":
        return path, "required field is missing"
    if error["type"] == "extra_forbidden":
        return path, "unknown field" + _did_you_mean(root, error["loc"])
    if error["type"] == "unknown_arch":
        return path, error["msg"]
    if error["type"] == "too_short":
        return path, f"needs at least {ctx['min_length']} item(s), got {ctx['actual_length']}"
    if error["type"] == "string_pattern_mismatch" and ctx.get("pattern") in PATTERN_HINTS:
        return path, f"expected {PATTERN_HINTS[ctx['pattern']]}{shown}"
    if error["type"] == "quantity_type":
        return path, error["msg"]
    return path, error["msg"] + shown


def _model_at(root: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model whose fields are at ``loc`` (camelCase names, list indices, map keys)."""
    model = root
    for part in loc:
        if isinstance(part, int):
            continue
        fields = {info.alias or name: info for name, info in model.model_fields.items()}
        if part not in fields:
            return None
        inner = _models_in(fields[part].annotation)
        if not inner:
            return None
        model = inner[0]
    return model


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _did_you_mean(root: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """A hint for an unknown field: the camelCase spelling, or the closest field name."""
    model = _model_at(root, loc[:-1])
    if model is None or not isinstance(loc[-1], str):
        return ""
    names = [info.alias or name for name, info in model.model_fields.items()]
    if (camel := to_camel(loc[-1])) in names and camel != loc[-1]:
        return f" (fields are camelCase: {camel})"
    close = difflib.get_close_matches(loc[-1], names, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def first_error(errors: list[ErrorDetails]) -> ErrorDetails:
    """The error to report: an unknown field before all else, since a misspelled field is
    also a missing one, and "missing" alone hides the typo."""
    return next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])


def one_line(text: str) -> str:
    return " ".join(text.split())
