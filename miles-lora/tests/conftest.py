"""miles-lora tests: make the spawned-job helper (``lora_job.py``) importable by the tests."""

from __future__ import annotations

import sys
from pathlib import Path

from miles.testing.fixtures import engines_may_load_test_weights  # noqa: F401  (autouse)

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
