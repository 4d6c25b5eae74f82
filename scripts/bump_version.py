"""Bump the lockstep version of every Miles package: ``python scripts/bump_version.py 0.2.0``.

Rewrites each package's ``version = ...``, its ``miles-*==`` sibling pins and ``miles/_version.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_files() -> list[Path]:
    files = sorted(ROOT.glob("miles-*/pyproject.toml")) + sorted(ROOT.glob("examples/plugins/*/pyproject.toml"))
    return [f for f in files if ".tox" not in f.parts]


def bump(version: str) -> list[Path]:
    if not re.fullmatch(r"\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?", version):
        raise SystemExit(f"not a version: {version!r} (expected e.g. 0.2.0 or 0.2.0rc1)")
    changed = []
    for path in package_files():
        text = path.read_text()
        is_core_family = path.parent.name.startswith("miles-")
        new = text
        if is_core_family:
            new = re.sub(r'(?m)^version = "[^"]+"', f'version = "{version}"', new, count=1)
        new = re.sub(r'"(miles-(?:core|fsdp|megatron|sglang|p2p|lora|diffusion))==[^"]+"', rf'"\1=={version}"', new)
        if new != text:
            path.write_text(new)
            changed.append(path)
    version_py = ROOT / "miles-core" / "src" / "miles" / "_version.py"
    version_py.write_text(f'__version__ = "{version}"\n')
    changed.append(version_py)
    return changed


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    for path in bump(sys.argv[1]):
        print(path.relative_to(ROOT))
