"""Turn pydantic validation errors into messages that name the field path and where its value came from."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import ValidationError

__all__ = ["dotted", "format_validation_error"]


def dotted(loc: Sequence[int | str], prefix: str = "") -> str:
    """``("reward", "functions", 0, "weight")`` -> ``reward.functions[0].weight``."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def format_validation_error(
    exc: ValidationError,
    *,
    prefix: str = "",
    context: str = "",
    source_of: Callable[[str], str | None] | None = None,
) -> str:
    """One line per problem: ``train.lr (config.toml:7): Input should be greater than 0 (got -1.0)``.

    :param prefix: field path the validated model sits at (``algorithm`` for an algorithm's settings).
    :param context: what was validated, for the first line.
    :param source_of: maps a field path to a source description (file:line, env var, --set).
    """
    lines = []
    for err in exc.errors():
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-after"))]
        path = dotted(loc, prefix) or prefix or "(settings)"
        kind = err["type"]
        msg = err["msg"]
        if kind == "extra_forbidden":
            msg = "unknown key"
        elif kind == "missing":
            msg = "required key is missing"
        elif err["msg"].startswith("Value error, "):
            msg = err["msg"][len("Value error, ") :]
        source = source_of(path) if source_of else None
        where = f" ({source})" if source else ""
        got = ""
        if kind not in ("extra_forbidden", "missing") and "input" in err and not isinstance(err["input"], dict):
            got = f" (got {err['input']!r})"
        # a model validator's message already names its field(s): do not prefix the section path
        if kind == "value_error" and ":" in msg.split(" ", 1)[0]:
            lines.append(f"{msg}{where}")
        else:
            lines.append(f"{path}{where}: {msg}{got}")
    head = f"invalid {context}:" if context else "invalid settings:"
    return "\n".join([head, *("  " + line for line in lines)])
