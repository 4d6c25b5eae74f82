"""SGLang's protocol as its own source states it, read with :mod:`ast` (nothing of SGLang is imported: it
needs CUDA). Used by the ``sglang-protocol`` checks to hold every flag, route and request field Miles
sends against the installed SGLang release:

- the server flags: ``ServerArgs`` fields declared in ``sglang/srt/arg_groups/fields/*.py``
  (``name: A[T, "help"]`` or ``A[T, Arg(cli_name=..., aliases=..., choices=..., no_cli=...)]``) plus
  the flags ``ServerArgs.add_cli_args`` registers by hand (``sglang/srt/server_args.py``);
- the HTTP routes of ``sglang/srt/entrypoints/http_server.py`` with their methods and request type;
- the fields of the request types (``sglang/srt/managers/io_struct.py``) and of ``SamplingParams``
  (``sglang/srt/sampling/sampling_params.py``), inherited ones included.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Flag", "Route", "SGLangSource", "Struct", "locate_sglang"]


@dataclass(frozen=True)
class Flag:
    """One ``sglang.launch_server`` flag."""

    name: str
    """``--tp-size``."""
    switch: bool
    """Takes no value (a ``bool`` field: ``store_true``)."""
    kind: str = "str"
    """The value's type name (``int``, ``float``, ``str``, ``list``)."""
    choices: tuple[str, ...] | None = None
    deprecated: bool = False
    nargs: str | None = None
    """argparse's ``nargs`` (``*`` / ``+``: a list of values after the flag)."""


@dataclass(frozen=True)
class Route:
    """One HTTP route of SGLang's server."""

    path: str
    methods: frozenset[str]
    request: str | None
    """Name of the request type of its body (``None``: the route reads no JSON body)."""


@dataclass
class Struct:
    """A request type: its fields and which of them are required."""

    name: str
    fields: set[str] = field(default_factory=set)
    required: set[str] = field(default_factory=set)


def locate_sglang() -> Path:
    """The installed ``sglang`` package directory (found, not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("sglang is not installed (pip install --no-deps sglang==<pinned version>)")
    return Path(next(iter(spec.submodule_search_locations)))


def _const_list(node: ast.expr | None) -> tuple[str, ...] | None:
    if isinstance(node, ast.List | ast.Tuple) and all(isinstance(e, ast.Constant) for e in node.elts):
        return tuple(str(e.value) for e in node.elts if isinstance(e, ast.Constant))
    return None


def _type_of(node: ast.expr) -> tuple[str, tuple[str, ...] | None]:
    """``(kind, literal choices)`` of a field's type annotation (``Optional[X]`` is ``X``)."""
    if isinstance(node, ast.Name):
        return node.id, None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        return _type_of(ast.parse(node.value, mode="eval").body)
    if isinstance(node, ast.Subscript):
        outer = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        if outer == "Optional":
            return _type_of(node.slice)
        if outer == "Literal":
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return "str", tuple(str(e.value) for e in items if isinstance(e, ast.Constant))
        if outer in ("List", "list"):
            return "list", None
        return outer, None
    if isinstance(node, ast.BinOp):  # X | None
        left, _ = _type_of(node.left)
        return (left if left != "None" else _type_of(node.right)[0]), None
    return "str", None


@functools.cache
def _module_constants(path: Path) -> dict[str, tuple[str, ...]]:
    """Top-level constants of a module that are strings or lists of strings (a string as a 1-tuple)."""
    out: dict[str, tuple[str, ...]] = {}
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        value = node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out[node.targets[0].id] = (value.value,)
        elif (listed := _const_list(value)) is not None:
            out[node.targets[0].id] = listed
    return out


def _imported_constants(tree: ast.Module, root: Path) -> dict[str, tuple[str, ...]]:
    """The string (list) constants a module imports from SGLang's own modules (``root``: the package)."""
    out: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang.")):
            continue
        path = root.parent.joinpath(*node.module.split(".")).with_suffix(".py")
        if path.exists():
            values = _module_constants(path)
            out.update({a.asname or a.name: values[a.name] for a in node.names if a.name in values})
    return out


def _choices(node: ast.expr | None, constants: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    """Literal choices, resolving names of imported constants and ``+`` of lists."""
    if node is None:
        return None
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _choices(node.left, constants), _choices(node.right, constants)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.List | ast.Tuple):
        parts = [_choices(e, constants) if isinstance(e, ast.Name) else _const_list(ast.List([e])) for e in node.elts]
        return None if any(p is None for p in parts) else tuple(v for p in parts if p is not None for v in p)
    return None


def _fields_flags(path: Path, root: Path | None = None) -> dict[str, Flag]:
    flags: dict[str, Flag] = {}
    tree = ast.parse(path.read_text())
    constants = _imported_constants(tree, root) if root is not None else {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for item in cls.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            ann = item.annotation
            if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "A"):
                continue
            if not (isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) >= 2):
                continue
            type_node, meta = ann.slice.elts[0], ann.slice.elts[1]
            kind, choices = _type_of(type_node)
            names = ["--" + item.target.id.replace("_", "-")]
            if isinstance(meta, ast.Call):
                keywords = {k.arg: k.value for k in meta.keywords if k.arg}
                no_cli = keywords.get("no_cli")
                if isinstance(no_cli, ast.Constant) and no_cli.value is True:
                    continue
                cli = keywords.get("cli_name")
                if isinstance(cli, ast.Constant):
                    names[0] = str(cli.value)
                names += list(_const_list(keywords.get("aliases")) or ())
                choices = _choices(keywords.get("choices"), constants) or choices
                nargs_node = keywords.get("nargs")
                nargs = str(nargs_node.value) if isinstance(nargs_node, ast.Constant) else None
                if "action" in keywords:
                    kind = "action"
            else:
                nargs = None
            for name in names:
                flags[name] = Flag(name, switch=kind == "bool", kind=kind, choices=choices, nargs=nargs)
    return flags


def _manual_flags(path: Path) -> dict[str, Flag]:
    """Flags ``ServerArgs.add_cli_args`` registers with ``parser.add_argument(...)`` itself."""
    flags: dict[str, Flag] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument":
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        action = keywords.get("action")
        action_name = action.value if isinstance(action, ast.Constant) else getattr(action, "id", "") if action else ""
        switch = "StoreTrue" in str(action_name) or action_name == "store_true"
        for name in names:
            flags[str(name)] = Flag(
                str(name),
                switch=switch,
                choices=_const_list(keywords.get("choices")),
                deprecated=str(action_name).startswith("Deprecated"),
            )
    return flags


def _routes(path: Path) -> dict[str, Route]:
    routes: dict[str, Route] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        request = None
        for arg in node.args.args:
            ann = arg.annotation
            if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
                ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
            if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
                ann = ann.slice
            if isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req")):
                request = ann.id
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)):
                continue
            verb = deco.func.attr
            if verb not in ("get", "post", "put", "api_route") or not deco.args:
                continue
            path_node = deco.args[0]
            if not isinstance(path_node, ast.Constant):
                continue
            keywords = {k.arg: k.value for k in deco.keywords if k.arg}
            methods = _const_list(keywords.get("methods")) if verb == "api_route" else (verb.upper(),)
            old = routes.get(str(path_node.value))
            merged = frozenset(methods or ()) | (old.methods if old else frozenset())
            routes[str(path_node.value)] = Route(
                str(path_node.value), merged, request or (old.request if old else None)
            )
    return routes


def _structs(*paths: Path) -> dict[str, Struct]:
    classes: dict[str, ast.ClassDef] = {}
    for path in paths:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node

    def resolve(name: str, seen: frozenset[str] = frozenset()) -> Struct:
        node = classes[name]
        struct = Struct(name)
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes and base.id not in seen:
                parent = resolve(base.id, seen | {name})
                struct.fields |= parent.fields
                struct.required |= parent.required
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                if "ClassVar" in ast.unparse(item.annotation):
                    continue
                struct.fields.add(item.target.id)
                if item.value is None:
                    struct.required.add(item.target.id)
                else:
                    struct.required.discard(item.target.id)
        return struct

    return {name: resolve(name) for name in classes}


@dataclass
class SGLangSource:
    """What one SGLang installation declares (see the module docstring)."""

    root: Path
    flags: dict[str, Flag]
    routes: dict[str, Route]
    structs: dict[str, Struct]
    version: str

    @classmethod
    def read(cls, root: Path | None = None) -> SGLangSource:
        """Parse the SGLang package at ``root`` (default: the installed one)."""
        root = root or locate_sglang()
        srt = root / "srt"
        flags: dict[str, Flag] = {}
        for path in sorted((srt / "arg_groups" / "fields").glob("*.py")):
            flags.update(_fields_flags(path, root))
        flags.update(_manual_flags(srt / "server_args.py"))
        version = "unknown"
        version_file = root / "_version.py"  # written at build time: __version__ = version = '0.5.23'
        if version_file.exists():
            for node in ast.walk(ast.parse(version_file.read_text())):
                targets = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
                if isinstance(node, ast.Assign) and "__version__" in targets and isinstance(node.value, ast.Constant):
                    version = str(node.value.value)
        return cls(
            root=root,
            flags=flags,
            routes=_routes(srt / "entrypoints" / "http_server.py"),
            structs=_structs(srt / "managers" / "io_struct.py", srt / "sampling" / "sampling_params.py"),
            version=version,
        )

    def field_literals(self, module: str, cls: str, name: str) -> tuple[str, ...] | None:
        """The ``Literal[...]`` values of field ``name`` of class ``cls`` in ``module`` (``None``: not a Literal)."""
        for node in ast.walk(self._module(module)):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == name:
                        _, choices = _type_of(item.annotation)
                        return choices
        return None

    def constants(self, module: str) -> dict[str, str]:
        """Top-level string constants of ``module`` (``GPU_MEMORY_TYPE_WEIGHTS = "weights"`` ...)."""
        out = {}
        for node in self._module(module).body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
        return out

    def tree(self, module: str) -> ast.Module:
        """The parsed source of ``module`` (``sglang.srt.environ``; a package: its ``__init__.py``), empty when
        SGLang has no such module."""
        base = self.root.parent.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.exists():
                return ast.parse(path.read_text())
        return ast.Module(body=[], type_ignores=[])

    def _module(self, module: str) -> ast.Module:
        return self.tree(module)

    def defines(self, module: str, name: str) -> bool:
        """Whether ``module`` (``sglang.srt.utils.common``) defines ``name`` at its top level."""
        return any(
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name
            for node in self._module(module).body
        )
