"""Pydantic errors about a sweep file in plain words: one ConfigError line each."""

from __future__ import annotations

import types
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from sweepmaster.config.search_space import did_you_mean
from sweepmaster.errors import ConfigError

__all__ = [
    "format_validation_error",
]


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               Path: "a path"}
_BOUND_WORDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _describe(annotation: Any, metadata: list[Any]) -> str:
    """Say in words what a type annotation (plus pydantic constraints) accepts."""
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *extra = get_args(annotation)
        return _describe(inner, [*metadata, *extra])
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        words = [_describe(arg, metadata) for arg in args if arg is not type(None)]
        return " or ".join(words + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in get_args(annotation))
    if annotation in _TYPE_WORDS:
        word = _TYPE_WORDS[annotation]
    elif origin is tuple:
        word = f"a list of {len(get_args(annotation))} items"
    elif origin is list:
        word = "a list"
    elif origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        word = "a mapping"
    else:
        word = "a value"
    flat = [m for item in metadata
            for m in (item.metadata if isinstance(item, FieldInfo) else [item])]
    bounds = [f"{op} {getattr(m, attr)}" for m in flat for attr, op in _BOUND_WORDS
              if getattr(m, attr, None) is not None]
    bounds += [f"matching {m.pattern}" for m in flat if getattr(m, "pattern", None)]
    if any(getattr(m, "min_length", None) for m in flat):
        word = word.replace("a ", "a non-empty ", 1)
    return " ".join([word, " and ".join(bounds)]) if bounds else word


def _locate(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, list[Any]] | None:
    """The annotation and constraints of the ``model`` entry at ``loc``, if it has one."""
    annotation: Any = model
    metadata: list[Any] = []
    for part in loc:
        while get_origin(annotation) in (Annotated, Union, types.UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            if get_origin(annotation) is not Annotated and len(args) != 1:
                return None
            annotation = args[0]
        origin = get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return None
            annotation, metadata = field.annotation, list(field.metadata)
        elif origin is dict:
            annotation, metadata = get_args(annotation)[1], []
        elif origin in (list, tuple) and isinstance(part, int):
            annotation, metadata = get_args(annotation)[part if origin is tuple else 0], []
        else:
            return None
    return annotation, metadata


def _user_loc(loc: tuple[Any, ...], raw: Any) -> tuple[Any, ...]:
    """The key path of a pydantic error as the user wrote it, less pydantic's own tags.

    Pydantic adds tags such as ``function-after[...]`` for validators and union members; a
    part containing ``[`` is such a tag unless the input has that key (``"[/]"`` is a key).
    """
    kept: list[Any] = []
    node = raw
    for part in loc:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(part, str) and "[" in part:
            continue
        else:
            node = None
        kept.append(part)
    return tuple(kept)


def format_validation_error(exc: ValidationError, source: str, raw: Any = None,
                            model: type[BaseModel] | None = None) -> ConfigError:
    """Turn a pydantic error about a SweepConfig into one plain-words ConfigError line.

    Args:
        exc: The error from validating a :class:`SweepConfig`.
        source: The file, for the message.
        raw: The validated input, to tell the user's keys from pydantic's location tags.
        model: The model that was validated (:class:`SweepConfig`), to describe what its
            fields expect; ``None``: pydantic's own words.

    Returns:
        A ConfigError for the first error: its dotted key path and what was expected there
        (with a did-you-mean for unknown keys and names), ``(and N more)`` if there are more.
    """
    errors = exc.errors()
    error = errors[0]
    loc = _user_loc(tuple(error["loc"]), raw)
    kind, value = error["type"], error.get("input")
    ours = model is not None and exc.title == model.__name__
    found = _locate(model, loc) if model is not None and ours else None
    if kind == "extra_forbidden":
        parent = _locate(model, loc[:-1]) if model is not None and ours else None
        allowed = list(parent[0].model_fields) if parent and isinstance(parent[0], type) \
            and issubclass(parent[0], BaseModel) else []
        expected = f"unknown key{did_you_mean(loc[-1], allowed)}"
        if allowed:
            expected += f" (allowed: {', '.join(allowed)})"
    elif kind == "missing":
        expected = "missing" + (f", expected {_describe(*found)}" if found else "")
    else:
        if kind in ("value_error", "assertion_error"):
            expected = str(error.get("ctx", {}).get("error", error["msg"]))
        elif found:
            expected = f"expected {_describe(*found)}"
            if kind == "finite_number":
                expected = expected.replace("a number", "a finite number")
        else:
            expected = error["msg"]
        shown = repr(value)
        expected += f", got {shown if len(shown) <= 60 else shown[:57] + '...'}"
        if found and get_origin(found[0]) is Literal:
            expected += did_you_mean(value, [str(a) for a in get_args(found[0])])
    if len(errors) > 1:
        expected += f" (and {len(errors) - 1} more)"
    return ConfigError(source, ".".join(str(p) for p in loc), expected)
