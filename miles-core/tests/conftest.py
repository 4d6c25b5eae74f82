"""Shared fixtures for miles-core tests."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from miles.testing.fixtures import engines_may_load_test_weights  # noqa: F401  (autouse)


@pytest.fixture(scope="session")
def tiny_vlm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """``(model, url)``: a tiny Qwen2-VL (:func:`miles.testing.vlm.build_tiny_vlm`, seed 0) and one local engine
    serving it, shared by the engine's and the session server's VLM tests (a start costs 15-50 s here). Tests
    must leave its weights as they found them."""
    pytest.importorskip("PIL")
    from miles.testing.engine import EngineProcess
    from miles.testing.vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("tiny-vlm")
    model = build_tiny_vlm(root / "model")
    with EngineProcess(model, log_path=root / "engine.log") as proc:
        yield model, proc.url


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Install a real (path-based) distribution exposing ``miles.plugins`` entry points.

    ``fake_distribution("miles-x", {"x": "miles_x_plugin"}, {"miles_x_plugin": "source"})`` writes the
    modules and a ``.dist-info`` with ``entry_points.txt`` into a folder on ``sys.path`` (and
    ``PYTHONPATH`` for subprocesses), exactly what pip would leave behind.
    """
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    added: list[str] = []

    def make(dist: str, entry_points: dict[str, str], modules: dict[str, str], version: str = "0.3.1") -> Path:
        for module, source in modules.items():
            (site / f"{module}.py").write_text(textwrap.dedent(source))
            added.append(module)
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[miles.plugins]\n{lines}\n")
        return site

    yield make
    for module in added:
        sys.modules.pop(module, None)


@pytest.fixture(autouse=True)
def _plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start with no plugin-selection variables from the developer's shell."""
    for var in ("MILES_DISABLE_PLUGINS", "MILES_LOAD_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
