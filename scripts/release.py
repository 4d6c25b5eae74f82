"""Build and check the release: ``python scripts/release.py build|check [--out DIR]`` (``tox -e release``
runs ``check``).

``build`` makes a wheel and an sdist of each of the eight Miles packages with ``python -m build`` (the wheel
is built from the sdist, so an sdist that misses a file fails here), into ``--out`` (default ``./dist``),
and refuses versions that are not in lockstep: every package's version, every ``miles-*==`` pin between
them and ``miles/_version.py`` must be the one version (``scripts/bump_version.py`` sets them).

``check`` builds, runs ``twine check`` on every file, installs the eight wheels into a fresh virtual
environment (with the repository's ``constraints.txt``: torch's pin), and there runs ``miles --version``
(all eight at the version) and ``miles plugins list --json`` (every plugin of the eight loads: status
``ok``). Until the packages are on PyPI this is how a release is installed: ``pip install dist/*.whl``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "miles-core", "miles-fsdp", "miles-megatron", "miles-sglang", "miles-p2p", "miles-lora", "miles-diffusion", "miles-envs",
)  # fmt: skip
"""The distributions released together, in dependency order."""


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(argv), flush=True)
    return subprocess.run(argv, check=True, text=True, **kwargs)


def lockstep_version() -> str:
    """The one version of every package, or ``SystemExit`` naming what differs."""
    import tomllib

    found: dict[str, str] = {}
    problems: list[str] = []
    for name in PACKAGES:
        project = tomllib.loads((ROOT / name / "pyproject.toml").read_text())["project"]
        found[name] = project["version"]
        for requirement in project.get("dependencies", []):
            pinned = re.fullmatch(r"(miles-[a-z0-9-]+)\s*==\s*(\S+)", requirement)
            if pinned and pinned.group(1) in PACKAGES:
                found[f"{name} -> {pinned.group(1)}"] = pinned.group(2)
    version_py = (ROOT / "miles-core" / "src" / "miles" / "_version.py").read_text()
    match = re.search(r'__version__ = "([^"]+)"', version_py)
    found["miles/_version.py"] = match.group(1) if match else "?"
    versions = set(found.values())
    if len(versions) != 1:
        problems = [f"  {where}: {version}" for where, version in sorted(found.items())]
        raise SystemExit(
            "versions are not in lockstep (python scripts/bump_version.py VERSION sets them all):\n"
            + "\n".join(problems)
        )
    return versions.pop()


def build(out: Path) -> list[Path]:
    """A wheel and an sdist of each package in ``out``; returns the files."""
    version = lockstep_version()
    out.mkdir(parents=True, exist_ok=True)
    installer = ["--installer", "uv"] if shutil.which("uv") else []
    start = time.monotonic()
    for name in PACKAGES:
        _run([sys.executable, "-m", "build", *installer, "--outdir", str(out), str(ROOT / name)])
    files = []
    for name in PACKAGES:
        stem = f"{name.replace('-', '_')}-{version}"
        wanted = [out / f"{stem}-py3-none-any.whl", out / f"{stem}.tar.gz"]
        missing = [f.name for f in wanted if not f.exists()]
        if missing:
            raise SystemExit(f"{name}: the build made no {', '.join(missing)} in {out}")
        files += wanted
    print(f"built {len(files)} files of version {version} in {time.monotonic() - start:.0f} s: {out}")
    return files


def check(out: Path) -> None:
    """Build, ``twine check``, install the wheels into a fresh environment and load every plugin."""
    files = build(out)
    version = lockstep_version()
    _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)])
    with tempfile.TemporaryDirectory(prefix="miles-release-") as scratch:
        venv = Path(scratch) / "venv"
        python = venv / "bin" / "python"
        wheels = [str(f) for f in files if f.suffix == ".whl"]
        constraints = ["-c", str(ROOT / "constraints.txt")]
        start = time.monotonic()
        if shutil.which("uv"):
            _run(["uv", "venv", "--quiet", "--python", sys.executable, str(venv)])
            _run(["uv", "pip", "install", "--quiet", "--python", str(python), *constraints, *wheels])
        else:
            _run([sys.executable, "-m", "venv", str(venv)])
            _run([str(python), "-m", "pip", "install", "--quiet", *constraints, *wheels])
        print(f"installed the {len(wheels)} wheels into a fresh environment in {time.monotonic() - start:.0f} s")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
        miles = str(venv / "bin" / "miles")
        listed = _run([miles, "--version"], env=env, capture_output=True).stdout.split("\n")
        expected = sorted(f"{name} {version}" for name in PACKAGES)
        if sorted(line for line in listed if line) != expected:
            raise SystemExit(f"miles --version in the fresh environment printed {listed!r}, expected {expected!r}")
        plugins = json.loads(_run([miles, "plugins", "list", "--json"], env=env, capture_output=True).stdout)
        by_distribution: dict[str, list[dict[str, object]]] = {}
        for plugin in plugins["plugins"]:
            by_distribution.setdefault(str(plugin["distribution"]), []).append(plugin)
        bad = [p for p in plugins["plugins"] if p["status"] != "ok"]
        absent = [name for name in PACKAGES if name not in by_distribution]
        if bad or absent:
            lines = [f"  {p['name']} ({p['distribution']}): {p['status']}: {p['error']}" for p in bad]
            lines += [f"  {name}: no plugin listed" for name in absent]
            raise SystemExit("miles plugins list in the fresh environment:\n" + "\n".join(lines))
        print(
            f"release {version}: {len(files)} files pass twine check; the wheels install together and "
            f"{len(plugins['plugins'])} plugins of {len(by_distribution)} distributions load"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("build", "check"))
    parser.add_argument("--out", type=Path, default=Path("dist"), help="where the files go (default ./dist)")
    args = parser.parse_args()
    (build if args.command == "build" else check)(args.out.resolve())


if __name__ == "__main__":
    main()
