"""The ``miles`` command line. Each sub-command lives in its own module and is added here."""

from __future__ import annotations

from miles.cli.app import app, main

__all__ = ["app", "main"]
