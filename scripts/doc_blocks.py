"""Run the code blocks of README.md and docs/ as a reader would: ``python scripts/doc_blocks.py [PATH ...]``
(what ``tox -e doctest`` runs). A doc that fails as written fails CI.

Every fenced block is checked by its language, unless the HTML comment just above it says otherwise:

- ``bash`` / ``sh`` / ``shell``: run with ``bash -e -o pipefail``; ``console``: its ``$ `` lines are run.
- ``python``: executed as a script (imports resolve, definitions run).
- ``toml`` / ``yaml``: a settings file, validated by ``miles train --dry-run`` (in this process, the CLI's
  own entry point).
- ``json``: parsed.
- anything else (``text``, no language): shown, not run.

The blocks of one page run in order in one scratch directory that looks like the repository root (each
top-level entry of the checkout is linked into it; what the commands write lands in the scratch directory,
and a block that changes the checkout fails the run). Shell blocks share the page's directory, not a shell:
each runs in a new ``bash`` in its own process group, which is killed when the block ends (a server a block
left running included). Install lines run against this environment, which already holds every package:
``pip install ARGS`` is ``uv pip install --dry-run ARGS`` (it must resolve: paths, extras, names and the
constraints), and ``python -m venv DIR`` makes an empty ``DIR/bin/activate``.

The comment above a block, ``<!-- doc: DIRECTIVE; DIRECTIVE ... -->``, takes these directives:

``skip: REASON``
    not run; the reason (the rest of the comment) is printed with the report (a GPU, a cluster, the whole
    test suite ...).
``file PATH``
    write the block to ``PATH`` in the scratch directory first ("save this as run.toml"), then check it.
``fragment``
    a TOML / YAML block that is part of a settings file: validated merged over a complete tiny run
    (:data:`BASE_RUN`), its own tables winning.
``pyproject``
    a TOML block that is (part of) a package's ``pyproject.toml``: parsed, and each ``miles.plugins``
    entry point must import.
``stand-in PATH=FIXTURE ...``
    the block names a placeholder path for the reader's own file; the check puts a fixture there
    (``tiny-model``: a tiny random Qwen2 with its tokenizer; ``prompts``: arithmetic chat prompts in
    JSONL with ``label`` and ``answer``; ``run``: a complete settings file, two GRPO steps on those).
``shorten ARGS``
    a long ``miles train`` run is run with ``ARGS`` appended (``--set`` overrides); the page must say
    ``ARGS`` in its text, so a reader knows the shorter form.
``exit N``
    the block must exit with status ``N`` (a command that is shown failing).
``output``
    a ``text`` block that must appear in the output of the block before it (whitespace-insensitive).
``pytest``
    a Python block that is a test module: run with pytest.
``timeout SECONDS``
    longer than the default 300 s.

The report names every block with its outcome and time, then the counts; the exit status is 1 if any
block failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PATHS = ("README.md", "docs", "examples/plugins", "miles-core/README.md", "miles-fsdp/README.md",
                 "miles-megatron/README.md", "miles-sglang/README.md", "miles-p2p/README.md",
                 "miles-lora/README.md", "miles-diffusion/README.md", "miles-envs/README.md")  # fmt: skip
SKIPPED_DIRS = {".git", ".tox", "runs", "site", "node_modules", "__pycache__"}
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py", "python3"}
SETTINGS = {"toml", "yaml", "yml"}
DIRECTIVES = {"skip", "file", "fragment", "pyproject", "stand-in", "shorten", "exit", "output", "pytest", "timeout"}
BASE_RUN = {
    "cluster": {"trainer_ranks": 1, "num_engines": 1},
    "data": {"path": "doc-fixtures/prompts.jsonl"},
    "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "max_new_tokens": 8},
    "train": {"model_path": "doc-fixtures/tiny-model", "num_rollouts": 2, "global_batch_size": 8},
    "algorithm": {"name": "grpo"},
    "reward": {"functions": [{"name": "exact_match"}]},
}
"""The run a ``fragment`` is merged over (the page's own tables win): a tiny model, arithmetic prompts."""


# -- parsing ------------------------------------------------------------------------------------------


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    text: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doc:\s*(?P<body>.*?)\s*-->\s*$")
_SNIPPET = re.compile(r'^\s*--8<--\s+"(?P<file>[^":]+)(?::(?P<section>[\w-]+))?"\s*$')
_SECTION_MARK = re.compile(r"^\s*#\s*--8<--\s*\[(start|end):[\w-]+\]\s*$")


def parse_directives(body: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    head, skip, reason = body.partition("skip:")  # a reason may hold anything: it runs to the end
    if skip:
        out["skip"] = reason.strip()
        if not out["skip"]:
            raise SystemExit(f"{where}: 'skip' needs a reason: <!-- doc: skip: WHY -->")
    for part in filter(None, (p.strip() for p in head.split(";"))):
        name, _, arg = part.partition(":") if part.startswith("skip") else part.partition(" ")
        name, arg = name.strip(), arg.strip()
        if name not in DIRECTIVES:
            raise SystemExit(f"{where}: unknown doc directive {name!r} (known: {', '.join(sorted(DIRECTIVES))})")
        if name == "skip" and not arg:
            raise SystemExit(f"{where}: 'skip' needs a reason: <!-- doc: skip: WHY -->")
        out[name] = arg
    return out


def _language(info: str) -> str:
    info = info.strip()
    if info.startswith("{"):  # attribute form: {.python title="..."}
        found = re.search(r"\.([\w+-]+)", info)
        return found.group(1).lower() if found else ""
    return info.split()[0].lower() if info else ""


def resolve_snippets(text: str, where: str) -> str:
    """Expand ``--8<-- "FILE"`` and ``--8<-- "FILE:SECTION"`` lines as pymdownx.snippets does (paths from
    the repository root; section marks dropped)."""
    out: list[str] = []
    for line in text.splitlines():
        found = _SNIPPET.match(line)
        if not found:
            out.append(line)
            continue
        source = ROOT / found.group("file")
        if not source.is_file():
            raise SystemExit(f"{where}: snippet {found.group('file')} does not exist")
        lines = source.read_text().splitlines()
        section = found.group("section")
        if section:
            try:
                start = next(i for i, s in enumerate(lines) if re.search(rf"--8<--\s*\[start:{section}\]", s))
                end = next(i for i, s in enumerate(lines) if re.search(rf"--8<--\s*\[end:{section}\]", s))
            except StopIteration:
                raise SystemExit(f"{where}: snippet {found.group('file')} has no section {section!r}") from None
            lines = lines[start + 1 : end]
        out.extend(s for s in lines if not _SECTION_MARK.match(s))
    return "\n".join(out) + "\n"


def parse(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the directives of the comment just above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        found = _FENCE.match(line)
        directive = _DIRECTIVE.match(line)
        if directive:
            pending = parse_directives(directive.group("body"), f"{path.relative_to(ROOT)}:{i + 1}")
        elif found:
            fence, indent = found.group("fence"), len(found.group("indent"))
            body: list[str] = []
            start = i
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
                body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
                i += 1
            where = f"{path.relative_to(ROOT)}:{start + 1}"
            text = resolve_snippets("\n".join(body), where)
            blocks.append(Block(path, start + 1, _language(found.group("info")), text, pending))
            pending = {}
        elif line.strip():
            pending = {}  # a directive applies to the block right after it (blank lines between are fine)
        i += 1
    return blocks


def visible_text(path: Path) -> str:
    """The page's prose as a reader sees it: comments removed, whitespace collapsed."""
    text = re.sub(r"<!--.*?-->", " ", path.read_text(encoding="utf-8"), flags=re.S)
    return " ".join(text.split())


def markdown_files(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for name in paths:
        path = (ROOT / name).resolve()
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.md") if not SKIPPED_DIRS.intersection(p.relative_to(ROOT).parts))
        elif path.is_file():
            found.append(path)
        else:
            raise SystemExit(f"{name}: no such file or folder")
    return found


# -- running ------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    block: Block
    status: str  # "ok", "failed", "skipped", "shown"
    seconds: float = 0.0
    detail: str = ""


SHIMS = {
    # `python -m venv DIR` makes an empty DIR/bin/activate; anything else is this environment's Python
    "python": 'if [ "${1-}" = -m ] && [ "${2-}" = venv ]; then shift 2; for d in "$@"; do case "$d" in -*) ;; '
    '*) mkdir -p "$d/bin"; : > "$d/bin/activate";; esac; done; exit 0; fi; exec "$DOC_PYTHON" "$@"',
    # `pip install ARGS` must resolve (paths, extras, constraints; every package named, from the index as if
    # it were not installed); nothing is installed
    "pip": 'if [ "${1-}" = install ]; then shift; exec "$DOC_PYTHON" "$DOC_SCRIPT" --pip-install "$@"; fi; '
    'exec "$DOC_UV" pip "$@" --python "$DOC_PYTHON"',
    # `miles train ...` of a block with `shorten ARGS`: ARGS appended
    "miles": 'if [ "${1-}" = train ] && [ -n "${DOC_SHORTEN-}" ]; then exec "$DOC_MILES" "$@" $DOC_SHORTEN; fi; '
    'exec "$DOC_MILES" "$@"',
}
"""Commands a block calls, as scripts first on its ``PATH`` (each execs the real one: ``kill %1`` of
a backgrounded command reaches it)."""
SHIMS |= {"python3": SHIMS["python"], "pip3": SHIMS["pip"]}


_VALUED = {"-c", "--constraint", "-r", "--requirement", "-e", "--editable", "-i", "--index-url",
           "--extra-index-url", "-f", "--find-links", "--target", "--prefix", "--python"}  # fmt: skip


def pip_install(args: list[str]) -> int:
    """What the ``pip`` shim runs for ``pip install ARGS``: ``uv pip install --dry-run`` of the same
    arguments, each package named by its name (not a folder) resolved again from the index even when this
    environment has it: an unpublished name fails, as it would for a reader."""
    names: list[str] = []
    value = False
    for arg in args:
        if value or arg.startswith("-"):
            value = arg in _VALUED
            continue
        if "/" not in arg and not arg.startswith("."):
            names.append(re.split(r"[\[<>=!~ ;@]", arg, maxsplit=1)[0])
    uv = os.environ["DOC_UV"]
    reinstall = [part for name in names for part in ("--reinstall-package", name)]
    argv = [uv, "pip", "install", "--dry-run", *reinstall, "--python", os.environ["DOC_PYTHON"], *args]
    return subprocess.call(argv)


class Page:
    """The scratch directory of one page and what its blocks left for the next one."""

    def __init__(self, path: Path, root: Path, fixtures: Fixtures) -> None:
        self.path = path
        self.fixtures = fixtures
        self.dir = root / re.sub(r"[^\w.-]+", "_", str(path.relative_to(ROOT)))
        self.dir.mkdir(parents=True)
        for entry in ROOT.iterdir():
            if entry.name not in SKIPPED_DIRS and not entry.name.startswith((".venv", ".tox")):
                (self.dir / entry.name).symlink_to(entry)
        self.last_output = ""
        self.visible = visible_text(path)
        self.counter = 0

    def place_stand_ins(self, spec: str, where: str) -> None:
        for item in spec.split():
            target, _, kind = item.partition("=")
            source = self.fixtures.get(kind, where)
            destination = self.dir / target
            destination.parent.mkdir(parents=True, exist_ok=True)
            if not destination.exists():
                destination.symlink_to(source)

    def run(self, block: Block) -> Outcome:
        d = block.directives
        if "skip" in d:
            return Outcome(block, "skipped", detail=d["skip"])
        if "output" in d:
            wanted, seen = " ".join(block.text.split()), " ".join(self.last_output.split())
            if wanted in seen:
                return Outcome(block, "ok", detail="output as shown")
            return Outcome(block, "failed", detail=f"this output was not printed; the block before printed:\n{seen}")
        lang = block.lang
        if lang not in SHELL | PYTHON | SETTINGS | {"json"} and "file" not in d:
            return Outcome(block, "shown")
        if "stand-in" in d:
            self.place_stand_ins(d["stand-in"], block.where)
        self.counter += 1
        start = time.monotonic()
        try:
            if "file" in d:
                target = self.dir / d["file"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(block.text)
            if lang in SHELL:
                ok, detail = self._shell(block)
            elif lang in PYTHON:
                ok, detail = self._python(block)
            elif "pyproject" in d:
                ok, detail = self._pyproject(block)
            elif lang in SETTINGS:
                ok, detail = self._settings(block)
            elif lang == "json":
                json.loads(block.text)
                ok, detail = True, "parsed"
            else:
                ok, detail = True, f"written to {d['file']}"
        except Exception as exc:  # a bug of this script or of the block: reported as the block's failure
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        return Outcome(block, "ok" if ok else "failed", time.monotonic() - start, detail)

    # -- kinds ------------------------------------------------------------------------------------------
    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            DOC_UV=self.fixtures.uv,
            DOC_PYTHON=sys.executable,
            DOC_MILES=str(Path(sys.executable).parent / "miles"),
            DOC_SCRIPT=str(Path(__file__).resolve()),
            PATH=os.pathsep.join([str(self.fixtures.shims), str(Path(sys.executable).parent), env.get("PATH", "")]),
            PYTHONPATH=str(self.dir),
            COLUMNS="200",
            NO_COLOR="1",
            PYTHONDONTWRITEBYTECODE="1",
        )
        env.update(extra or {})
        return env

    def _subprocess(self, argv: list[str], block: Block, env: dict[str, str]) -> tuple[bool, str]:
        timeout = float(block.directives.get("timeout") or 300)
        expected = int(block.directives.get("exit") or 0)
        log = self.dir / f".doc-block-{self.counter}.log"
        with open(log, "w") as sink:  # a file, not a pipe: a server the block leaves running keeps no pipe open
            proc = subprocess.Popen(
                argv, cwd=self.dir, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                with contextlib.suppress(ProcessLookupError):  # what the block left running (its own group)
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out = log.read_text(errors="replace")
        self.last_output = out
        if code is None:
            return False, f"timed out after {timeout:g} s; output:\n{out[-4000:]}"
        if code != expected:
            return False, f"exit status {code}, expected {expected}; output:\n{out[-4000:]}"
        return True, f"exit {code}"

    def _shell(self, block: Block) -> tuple[bool, str]:
        d = block.directives
        script = block.text
        if block.lang == "console":
            commands, current = [], ""
            for line in block.text.splitlines():
                if line.startswith("$ ") or current:
                    current += line.removeprefix("$ ") + "\n"
                    if not line.rstrip().endswith("\\"):
                        commands.append(current)
                        current = ""
            script = "".join(commands)
        extra: dict[str, str] = {}
        if "shorten" in d:
            said = " ".join(d["shorten"].split())
            if said not in self.visible:
                return False, f"shorten: the page does not say {said!r} in its text"
            extra["DOC_SHORTEN"] = said
        name = self.dir / f".doc-block-{self.counter}.sh"
        name.write_text("set -e -o pipefail\n" + script)
        return self._subprocess(["bash", str(name)], block, self._env(extra))

    def _python(self, block: Block) -> tuple[bool, str]:
        if "pytest" in block.directives:
            name = self.dir / f"test_doc_block_{self.counter}.py"
            name.write_text(block.text)
            argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(name)]
        else:
            name = self.dir / f".doc-block-{self.counter}.py"
            name.write_text(block.text)
            argv = [sys.executable, str(name)]
        return self._subprocess(argv, block, self._env())

    def _pyproject(self, block: Block) -> tuple[bool, str]:
        import importlib

        import tomllib

        data = tomllib.loads(block.text)
        plugins = data.get("project", {}).get("entry-points", {}).get("miles.plugins", {})
        sys.path.insert(0, str(self.dir))
        try:
            for name, module in plugins.items():
                try:
                    importlib.import_module(module)
                except ImportError as exc:
                    return False, f"entry point {name} = {module!r} does not import: {exc}"
        finally:
            sys.path.remove(str(self.dir))
        return True, f"parsed; entry points import: {', '.join(plugins) or 'none'}"

    def _settings(self, block: Block) -> tuple[bool, str]:
        d = block.directives
        suffix = ".toml" if block.lang == "toml" else ".yaml"
        if "fragment" in d:
            import yaml

            self.place_stand_ins("doc-fixtures/tiny-model=tiny-model doc-fixtures/prompts.jsonl=prompts", block.where)
            if block.lang == "toml":
                import tomllib

                part = tomllib.loads(block.text)
            else:
                part = yaml.safe_load(block.text) or {}
            path = self.dir / f".doc-block-{self.counter}.yaml"
            path.write_text(yaml.safe_dump(_merge(BASE_RUN, part), sort_keys=False))
        elif "file" in d:
            path = self.dir / d["file"]
        else:
            path = self.dir / f".doc-block-{self.counter}{suffix}"
            path.write_text(block.text)
        return dry_run(path, self.dir)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def dry_run(path: Path, cwd: Path) -> tuple[bool, str]:
    """``miles train --dry-run PATH`` through the CLI's own entry point, in this process (the plugins load
    once for every block)."""
    from miles.cli.app import main

    out = io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            main(["train", "--dry-run", str(path)])
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        os.chdir(here)
    if code:
        return False, f"miles train --dry-run failed ({code}):\n{out.getvalue()[-4000:]}"
    return True, "miles train --dry-run"


RUN_FIXTURE = """\
[cluster]
trainer_ranks = 1
num_engines = 1

[data]
path = "{prompts}"

[rollout]
rollout_batch_size = 4
n_samples_per_prompt = 4
max_new_tokens = 8

[train]
model_path = "{model}"
num_rollouts = 2
global_batch_size = 8

[algorithm]
name = "grpo"

[[reward.functions]]
name = "exact_match"

[log]
run_dir = "{run_dir}"
"""
"""The ``run`` stand-in: a complete settings file of a two-step GRPO run on the tiny model."""


class Fixtures:
    """What ``stand-in`` puts in place, built once per run."""

    def __init__(self, root: Path) -> None:
        self.root = root / "fixtures"
        self.root.mkdir()
        self._built: dict[str, Path] = {}
        self.uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv") or "uv"
        self.shims = root / "bin"
        self.shims.mkdir()
        for name, body in SHIMS.items():
            (self.shims / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
            (self.shims / name).chmod(0o755)

    def get(self, kind: str, where: str) -> Path:
        if kind in self._built:
            return self._built[kind]
        if kind == "tiny-model":
            from miles.testing.models import build_tiny_model

            path = build_tiny_model(self.root / "tiny-model", "qwen2", seed=0)
        elif kind == "prompts":
            path = self.root / "prompts.jsonl"
            rows = [
                {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": str(a + b), "answer": str(a + b)}
                for a in range(3, 9)
                for b in range(2, 6)
            ]  # fmt: skip
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        elif kind == "run":
            path = self.root / "run.toml"
            model, prompts = self.get("tiny-model", where), self.get("prompts", where)
            path.write_text(RUN_FIXTURE.format(model=model, prompts=prompts, run_dir=self.root / "runs" / "run"))
        else:
            raise SystemExit(f"{where}: unknown stand-in fixture {kind!r} (tiny-model, prompts, run)")
        self._built[kind] = Path(path)
        return Path(path)


def checkout_state() -> str:
    try:
        return subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True, text=True,
            check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--pip-install"]:
        return pip_install(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("paths", nargs="*", help="Markdown files or folders (default: README.md, docs, examples ...)")
    parser.add_argument("--list", action="store_true", help="list the blocks and what would be done, run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directories (their path is printed)")
    args = parser.parse_args(argv)

    files = markdown_files(args.paths or list(DEFAULT_PATHS))
    pages = [(path, parse(path)) for path in files]
    if args.list:
        for _, blocks in pages:
            for block in blocks:
                print(
                    f"{block.where:48} {block.lang or '-':8} {'; '.join(f'{k} {v}'.strip() for k, v in block.directives.items())}"
                )
        return 0

    before = checkout_state()
    root = Path(tempfile.mkdtemp(prefix="miles-doc-blocks-"))
    fixtures = Fixtures(root)
    outcomes: list[Outcome] = []
    started = time.monotonic()
    try:
        for path, blocks in pages:
            if not blocks:
                continue
            page = Page(path, root, fixtures)
            for block in blocks:
                outcome = page.run(block)
                outcomes.append(outcome)
                if outcome.status in ("ok", "failed"):
                    mark = "ok    " if outcome.status == "ok" else "FAILED"
                    print(
                        f"{mark} {block.where:48} {block.lang:8} {outcome.seconds:6.1f} s  {outcome.detail.splitlines()[0] if outcome.detail else ''}",
                        flush=True,
                    )
                    if outcome.status == "failed":
                        print(textwrap.indent(block.text.rstrip(), "    | "))
                        print(textwrap.indent(outcome.detail, "    "), flush=True)
                elif outcome.status == "skipped":
                    print(f"skip   {block.where:48} {block.lang:8}           {outcome.detail}", flush=True)
    finally:
        if args.keep:
            print(f"scratch directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    after = checkout_state()

    run = [o for o in outcomes if o.status in ("ok", "failed")]
    failed = [o for o in run if o.status == "failed"]
    skipped = [o for o in outcomes if o.status == "skipped"]
    shown = [o for o in outcomes if o.status == "shown"]
    kinds: dict[str, int] = {}
    for o in run:
        kind = ("shell" if o.block.lang in SHELL else "python" if o.block.lang in PYTHON else
                "output" if "output" in o.block.directives else
                "pyproject" if "pyproject" in o.block.directives else
                "settings" if o.block.lang in SETTINGS else o.block.lang)  # fmt: skip
        kinds[kind] = kinds.get(kind, 0) + 1
    print(
        f"\n{len(run)} blocks run in {len(files)} files ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), "
        f"{len(failed)} failed; {len(skipped)} skipped with a reason; {len(shown)} shown only (text, output); "
        f"{time.monotonic() - started:.0f} s"
    )
    if after != before:
        print("FAILED: the blocks changed the checkout (git status):\n" + after)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
