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
