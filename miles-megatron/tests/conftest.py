"""miles-megatron tests: make the spawned-job helpers (``megatron_job.py`` ...) importable by the tests.

Megatron runs only in subprocesses (its CPU patches are process-wide); the tests themselves import
neither megatron nor the patches.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
