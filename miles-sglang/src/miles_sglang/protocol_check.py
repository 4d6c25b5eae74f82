"""Holding what Miles sends against SGLang's declared protocol (:class:`~miles_sglang.sglang_source.SGLangSource`).

- :func:`argv_problems`: every flag of a launch command is an SGLang flag, a switch where SGLang's is
  one, with a value of its type (and among its choices) where it takes one;
- :func:`request_problems`: a request goes to a route SGLang serves with that method, and its JSON
  fields (and ``sampling_params`` keys) are fields of the route's request type, the required ones present;
- :func:`session_problems`: weight loads over the network (``/update_weights_from_distributed``,
  ``/update_weights_from_tensor``) happen inside ``/begin_weight_update`` ... ``/end_weight_update``,
  per engine, as SGLang requires.

Each returns human-readable problems (empty: compatible), so a test can print them all at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from miles_sglang.sglang_source import SGLangSource

__all__ = ["MILES_ONLY_ROUTES", "Call", "argv_problems", "request_problems", "session_problems"]

MILES_ONLY_ROUTES = frozenset({"/weights_checksum", "/debug/randomize_weights"})
"""Routes only the local engine serves; Miles calls them only for engines that advertise them."""

_SESSION_LOADS = frozenset({"/update_weights_from_distributed", "/update_weights_from_tensor"})


@dataclass(frozen=True)
class Call:
    """One HTTP request Miles made: to which engine, which route, with which JSON body."""

    method: str
    url: str
    endpoint: str
    payload: dict[str, Any] | None


def _value_problem(flag: str, kind: str, value: str, choices: tuple[str, ...] | None) -> str | None:
    try:
        if kind == "int":
            int(value)
        elif kind == "float":
            float(value)
    except ValueError:
        return f"{flag} {value!r}: SGLang expects {kind}"
    if choices is not None and value not in choices:
        return f"{flag} {value!r}: SGLang accepts {', '.join(choices)}"
    return None


def argv_problems(argv: Sequence[str], source: SGLangSource, *, skip: Iterable[str] = ()) -> list[str]:
    """Problems of the flags in ``argv`` (after ``-m sglang.launch_server`` or ``-m miles_sglang.serve``, which
    runs it); ``skip`` flags are not checked (free-form ``extra_args``)."""
    args = list(argv)
    for module in ("sglang.launch_server", "miles_sglang.serve"):
        if module in args:
            args = args[args.index(module) + 1 :]
            break
    skipped = set(skip)
    problems = []
    i = 0
    while i < len(args):
        if not args[i].startswith("--"):
            problems.append(f"{args[i]!r}: a value without a flag")
            i += 1
            continue
        flag, eq, inline = args[i].partition("=")
        value: str | None
        if eq:  # --flag=value: the value is this argument's, whatever it starts with
            value, step = inline, 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, step = args[i + 1], 2
        else:
            value, step = None, 1
        declared = source.flags.get(flag)
        values = 1
        if declared is not None and declared.nargs in ("*", "+") and flag not in skipped:
            values = 0
            while i + 1 + values < len(args) and not args[i + 1 + values].startswith("--"):
                values += 1
            problems += [
                f"{flag} {v!r}: SGLang accepts {', '.join(declared.choices)}"
                for v in args[i + 1 : i + 1 + values]
                if declared.choices is not None and v not in declared.choices
            ]
            if declared.nargs == "+" and values == 0:
                problems.append(f"{flag}: SGLang expects one value or more")
            i += 1 + values
            continue
        if flag in skipped:
            pass
        elif declared is None:
            problems.append(f"{flag}: not a flag of SGLang {source.version}")
        elif declared.deprecated:
            problems.append(f"{flag}: deprecated in SGLang {source.version}")
        elif declared.switch and value is not None:
            problems.append(f"{flag}: a switch in SGLang, given the value {value!r}")
        elif not declared.switch and value is None:
            problems.append(f"{flag}: SGLang expects a value")
        elif value is not None:
            problem = _value_problem(flag, declared.kind, value, declared.choices)
            if problem:
                problems.append(problem)
        i += step
    return problems


def request_problems(call: Call, source: SGLangSource) -> list[str]:
    """Problems of one request against SGLang's routes and request types."""
    where = f"{call.method} {call.endpoint}"
    if call.endpoint in MILES_ONLY_ROUTES:
        return []
    route = source.routes.get(call.endpoint)
    if route is None:
        return [f"{where}: SGLang {source.version} has no such route"]
    if call.method not in route.methods:
        return [f"{where}: SGLang serves it with {', '.join(sorted(route.methods))} only"]
    payload = call.payload or {}
    if route.request is None:
        return [f"{where}: SGLang reads no body here, got fields {sorted(payload)}"] if payload else []
    struct = source.structs.get(route.request)
    if struct is None:
        return [f"{where}: request type {route.request} not found in SGLang's source"]
    problems = [
        f"{where}: {key!r} is not a field of SGLang's {struct.name}" for key in payload if key not in struct.fields
    ]
    problems += [f"{where}: SGLang's {struct.name} requires {key!r}" for key in sorted(struct.required - set(payload))]
    sampling = payload.get("sampling_params")
    if call.endpoint == "/generate" and isinstance(sampling, dict):
        allowed = source.structs["SamplingParams"].fields
        problems += [
            f"{where}: sampling_params[{key!r}] is not a field of SGLang's SamplingParams"
            for key in sampling
            if key not in allowed
        ]
    return problems


def session_problems(calls: Iterable[Call]) -> list[str]:
    """Weight loads outside a weight-update session, sessions opened twice or left open (per engine)."""
    open_session: dict[str, bool] = {}
    problems = []
    for call in calls:
        state = open_session.get(call.url, False)
        if call.endpoint == "/begin_weight_update":
            if state:
                problems.append(f"{call.url}: /begin_weight_update while a session is open")
            open_session[call.url] = True
        elif call.endpoint == "/end_weight_update":
            if not state:
                problems.append(f"{call.url}: /end_weight_update without a session")
            open_session[call.url] = False
        elif call.endpoint in _SESSION_LOADS and not state:
            problems.append(f"{call.url}: {call.endpoint} outside /begin_weight_update ... /end_weight_update")
    problems += [f"{url}: a weight-update session was left open" for url, state in open_session.items() if state]
    return problems
