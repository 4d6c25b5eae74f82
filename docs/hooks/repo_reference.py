"""The reference pages read in the repository too: ``python docs/hooks/repo_reference.py [--check]``.

A reference page documents modules with mkdocstrings' ``::: module`` directives, which only the built site
expands. In the repository each directive sits in a comment, ``<!-- site: ... -->``, and is followed by an
index of what it documents, generated from the source (every member with its signature and the first
sentence of its docstring) between ``<!-- repo: ... -->`` and ``<!-- /repo -->``. GitHub shows the index;
the site shows the full reference: as a MkDocs hook, this module unwraps the directives and drops the
indexes, and it fails the (strict) build when an index no longer matches the code, naming the command that
regenerates it. The source is read with :mod:`ast`: nothing is imported.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("docs/reference/hooks.md", "docs/reference/interfaces.md", "docs/reference/testing.md")
SOURCES = ("miles-core/src", "miles-p2p/src")
"""Where modules are looked up (as mkdocstrings' ``paths``)."""

_SITE_PATTERN = r"<!-- site:\n(?P<directive>::: (?P<module>[\w.]+)\n(?:    [^\n]*\n)*)-->\n"
_REPO_PATTERN = r"<!-- repo: [^\n]*-->\n(?:(?!<!-- /repo -->)[^\n]*\n)*<!-- /repo -->\n"
_SITE = re.compile(_SITE_PATTERN)
_REPO = re.compile(_REPO_PATTERN)
_BLOCK = re.compile(_SITE_PATTERN + r"(?:" + _REPO_PATTERN + r")?")


def _source(module: str) -> Path:
    for base in SOURCES:
        path = ROOT / base / Path(*module.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    raise SystemExit(f"docs/hooks/repo_reference.py: no source for module {module!r} under {', '.join(SOURCES)}")


def _members_option(directive: str) -> list[str] | None:
    found = re.search(r"members:\s*\[([^\]]*)\]", directive)
    return [m.strip() for m in found.group(1).split(",") if m.strip()] if found else None


def _first_sentence(doc: str | None) -> str:
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    text = re.sub(r":[a-z]+:`~?(?:[\w.]+\.)?([\w]+)`", r"`\1`", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    cut = re.search(r"(?<=[a-z0-9)`'\"])\.(\s|$)", text)
    text = text[: cut.start() + 1] if cut else text
    return text.replace("|", "\\|")


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg:
        names.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        names.append("*")
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append(f"**{args.kwarg.arg}")
    return f"{node.name}({', '.join(names)})"


def _top_level(tree: ast.Module) -> dict[str, tuple[str, str, str]]:
    """``{name: (kind, shown as, docstring)}`` of the module's classes, functions and documented names."""
    found: dict[str, tuple[str, str, str]] = {}
    body = tree.body
    for i, node in enumerate(body):
        if isinstance(node, ast.ClassDef):
            found[node.name] = ("class", node.name, ast.get_docstring(node) or "")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = ("function", _signature(node), ast.get_docstring(node) or "")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            following = body[i + 1] if i + 1 < len(body) else None
            doc = (
                following.value.value
                if isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
                else ""
            )
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id] = ("data", target.id, doc)
    return found


def _public(tree: ast.Module, members: dict[str, tuple[str, str, str]]) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                names = ast.literal_eval(node.value)
            except ValueError:  # a computed __all__ (the hook specs): every public function
                break
            return [n for n in names if n in members]
    return [n for n, (kind, _, _) in members.items() if not n.startswith("_") and kind != "data"]


def index(module: str, directive: str) -> str:
    """The repository's index of one ``::: module`` directive."""
    path = _source(module)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    members = _top_level(tree)
    names = _members_option(directive) or _public(tree, members)
    rows = []
    for name in names:
        if name not in members:
            raise SystemExit(f"docs/hooks/repo_reference.py: {module} has no top-level {name!r}")
        kind, shown, doc = members[name]
        rows.append(f"| `{shown}` | {kind} | {_first_sentence(doc)} |")
    where = path.relative_to(ROOT)
    head = f"<!-- repo: generated by `python docs/hooks/repo_reference.py` from {where}; the site shows the full reference -->"
    return "\n".join(
        [head, f"`{module}` ({where}):", "", "| name | kind | |", "|---|---|---|", *rows, "<!-- /repo -->", ""]
    )


def render(text: str) -> str:
    """The page with every directive's index regenerated."""

    def one(found: re.Match[str]) -> str:
        return f"<!-- site:\n{found.group('directive')}-->\n{index(found.group('module'), found.group('directive'))}"

    return _BLOCK.sub(one, text)


def for_site(text: str) -> str:
    """What the site builds from: the directives unwrapped, the indexes left out."""
    return _SITE.sub(lambda m: m.group("directive"), _REPO.sub("", text))


# -- MkDocs hook ------------------------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if "<!-- site:" not in markdown:
        return markdown
    if render(markdown) != markdown:
        from mkdocs.exceptions import PluginError

        raise PluginError(
            f"{page.file.src_uri}: its index of the reference is out of date with the code; regenerate it with "
            "`python docs/hooks/repo_reference.py`"
        )
    return for_site(markdown)


def main(argv: list[str]) -> int:
    stale = []
    for name in PAGES:
        path = ROOT / name
        text = path.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            stale.append(name)
            if "--check" not in argv:
                path.write_text(new, encoding="utf-8")
    if stale and "--check" in argv:
        print(f"out of date: {', '.join(stale)} (python docs/hooks/repo_reference.py)")
        return 1
    print(("rewrote " + ", ".join(stale)) if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
