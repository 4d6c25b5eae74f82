"""The engine's border: code outside ``miles.engine`` names only its declared public modules
(``miles.engine.PUBLIC_MODULES``), every other module of the package is on the ``engine-border`` import
contract's forbidden list, and no point-to-point code lives in the engine (miles-p2p adds its routes)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

import miles.engine
from miles.engine import PUBLIC_MODULES

ENGINE = Path(miles.engine.__file__).parent
REPO = Path(__file__).resolve().parents[3]
BACKENDS = [
    "miles-fsdp",
    "miles-megatron",
    "miles-diffusion",
    "miles-sglang",
    "miles-p2p",
    "miles-lora",
    "examples/plugins",
]

needs_repo = pytest.mark.skipif(not (REPO / ".importlinter").is_file(), reason="needs the repository checkout")


def _engine_modules() -> set[str]:
    return {f"miles.engine.{p.stem}" for p in ENGINE.glob("*.py") if p.stem not in ("__init__", "__main__")}


def test_public_modules_exist_and_are_named_in_the_package_docstring() -> None:
    assert set(PUBLIC_MODULES) <= _engine_modules()
    doc = miles.engine.__doc__ or ""
    assert all(f":mod:`{name}`" in doc for name in PUBLIC_MODULES)


@needs_repo
def test_the_import_contract_forbids_every_private_module() -> None:
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    forbidden = set(config["importlinter:contract:engine-border"]["forbidden_modules"].split())
    assert forbidden == _engine_modules() - set(PUBLIC_MODULES)


@needs_repo
def test_backend_packages_name_only_public_engine_modules() -> None:
    named: dict[str, set[str]] = {}
    for folder in BACKENDS:
        for path in (REPO / folder).rglob("*.py"):
            for module in re.findall(r"\bmiles\.engine\.\w+", path.read_text(encoding="utf-8")):
                named.setdefault(module, set()).add(str(path.relative_to(REPO)))
    assert named, "no backend names an engine module: the scan found nothing"
    private = {m: sorted(paths) for m, paths in named.items() if m not in PUBLIC_MODULES}
    assert not private


def test_no_point_to_point_code_in_the_engine() -> None:
    assert not [p.name for p in ENGINE.rglob("*.py") if "p2p" in p.name]
    assert not [p.name for p in ENGINE.rglob("*.py") if "/p2p/" in p.read_text(encoding="utf-8")]
