"""Turn pydantic validation errors into messages that name the field path and where its value came from."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = ["did_you_mean", "dotted", "format_validation_error"]


def dotted(loc: Sequence[int | str], prefix: str = "") -> str:
    """``("reward", "functions", 0, "weight")`` -> ``reward.functions[0].weight``."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The settings model an annotation holds (``X``, ``X | None``, ``list[X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def did_you_mean(model: type[BaseModel] | None, loc: Sequence[int | str]) -> str:
    """`` (did you mean 'num_rollouts'?)`` for an unknown key at ``loc`` of ``model``, when a field of the
    model that holds it is spelled alike; else ``""``."""
    current = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an item of a list: the field's annotation already named its model
        info = current.model_fields.get(part) if current is not None else None
        current = _model_in(info.annotation) if info is not None else None
    if current is None or not loc or not isinstance(loc[-1], str):
        return ""
    names = [*current.model_fields, *(f.alias for f in current.model_fields.values() if f.alias)]
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def format_validation_error(
    exc: ValidationError,
    *,
    prefix: str = "",
    context: str = "",
    source_of: Callable[[str], str | None] | None = None,
    model: type[BaseModel] | None = None,
) -> str:
    """One line per problem: ``train.lr (config.toml:7): Input should be greater than 0 (got -1.0)``.

    :param prefix: field path the validated model sits at (``algorithm`` for an algorithm's settings).
    :param context: what was validated, for the first line.
    :param source_of: maps a field path to a source description (file:line, env var, --set).
    :param model: the validated model: an unknown key gets the field spelled most like it, if one is.
    """
    lines = []
    for err in exc.errors():
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-after"))]
        path = dotted(loc, prefix) or prefix or "(settings)"
        kind = err["type"]
        msg = err["msg"]
        if kind == "extra_forbidden":
            msg = "unknown key" + did_you_mean(model, loc)
        elif kind == "missing":
            msg = "required key is missing"
        elif err["msg"].startswith("Value error, "):
            msg = err["msg"][len("Value error, ") :]
        # a model validator's message starts with the field it is about: "train.global_batch_size: ..."
        named = msg.split(" ", 1)[0]
        if kind == "value_error" and named.endswith(":") and "." in named:
            path, msg = named[:-1], msg[len(named) :].strip()
            if prefix and not path.startswith(prefix):
                path = f"{prefix}.{path}"
        source = source_of(path) if source_of else None
        where = f" ({source})" if source else ""
        got = ""
        if (
            kind not in ("extra_forbidden", "missing", "value_error")
            and "input" in err
            and not isinstance(err["input"], dict)
        ):
            got = f" (got {err['input']!r})"
        lines.append(f"{path}{where}: {msg}{got}")
    head = f"invalid {context}:" if context else "invalid settings:"
    return "\n".join([head, *("  " + line for line in lines)])
