"""Security properties checked over the whole source tree (issue 22).

No pickle on any path: weights travel as safetensors, control values as JSON.

Scans the source of every package in this repository (and the benchmarks and GPU scripts) with ``ast`` for
what unpickles or pickles: the ``pickle`` family of modules, ``torch.load`` without ``weights_only=True``,
``numpy.load`` with ``allow_pickle``, and torch.distributed's object collectives (they pickle). The one
allowed use is Megatron's checkpoint check, which reads Megatron's own pickles with a restricted unpickler
*before* Megatron does (``miles_megatron/checkpoint_safety.py``).

Every server binds 127.0.0.1 unless told otherwise: each ``host`` setting, parameter or CLI option with
a default defaults to loopback.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ["miles-*/src", "examples/**/src", "benchmarks", "scripts"]
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
OBJECT_COLLECTIVES = {
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}
ALLOWED = {"miles-megatron/src/miles_megatron/checkpoint_safety.py"}


def _files() -> list[Path]:
    found: set[Path] = set()
    for pattern in SCANNED:
        for root in REPO.glob(pattern):
            found.update(p for p in root.rglob("*.py") if ".tox" not in p.parts and "__pycache__" not in p.parts)
    return sorted(found)


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def problems_in(source: str, where: str) -> list[str]:
    """What in ``source`` pickles or unpickles, as ``where:line: ...`` lines."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [f"{where}:{node.lineno}: import {a.name}" for a in node.names if a.name in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLING_MODULES:
            out.append(f"{where}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, owner = node.func.attr, node.func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if attr == "load" and owner_name == "torch":
                weights_only = _keyword(node, "weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    out.append(f"{where}:{node.lineno}: torch.load without weights_only=True")
            elif attr == "load" and owner_name in ("np", "numpy"):
                allow = _keyword(node, "allow_pickle")
                if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                    out.append(f"{where}:{node.lineno}: numpy.load with allow_pickle")
            elif attr in OBJECT_COLLECTIVES:
                out.append(f"{where}:{node.lineno}: {attr} (pickles its objects)")
    return out


def test_the_scan_finds_what_it_looks_for() -> None:
    source = (
        "import pickle\nfrom cloudpickle import dumps\nimport torch, numpy as np\n"
        "torch.load('x')\ntorch.load('x', weights_only=False)\ntorch.load('x', weights_only=True)\n"
        "np.load('x', allow_pickle=True)\nimport torch.distributed as dist\ndist.all_gather_object([], 1)\n"
    )
    found = problems_in(source, "f.py")
    assert [line.split(": ", 1)[0] for line in found] == [f"f.py:{n}" for n in (1, 2, 4, 5, 7, 9)], found


def test_no_package_pickles() -> None:
    files = _files()
    assert len(files) > 100 and any("miles_fsdp" in str(p) for p in files)
    found: list[str] = []
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        if rel not in ALLOWED:
            found += problems_in(path.read_text(encoding="utf-8"), rel)
    assert not found, "\n".join(found)


def host_defaults_in(source: str, where: str) -> list[str]:
    """Every default given to something named ``host`` in ``source`` that is not loopback."""
    out: list[str] = []

    def check(value: ast.expr | None, line: int) -> None:
        if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value != "127.0.0.1":
            out.append(f"{where}:{line}: host defaults to {value.value!r}")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "host":
            check(node.value, node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
            for arg, default in pairs:
                if arg.arg == "host":
                    check(default, node.lineno)
    return sorted(out, key=lambda line: int(line.split(":")[1]))


def test_the_host_scan_finds_a_public_default() -> None:
    source = 'class S:\n    host: str = "0.0.0.0"\ndef serve(*, host: str = "::"): ...\ndef ok(host="127.0.0.1"): ...\n'
    assert host_defaults_in(source, "f.py") == ["f.py:2: host defaults to '0.0.0.0'", "f.py:3: host defaults to '::'"]


def test_every_server_binds_loopback_by_default() -> None:
    found: list[str] = []
    for path in _files():
        found += host_defaults_in(path.read_text(encoding="utf-8"), path.relative_to(REPO).as_posix())
    assert not found, "\n".join(found)
