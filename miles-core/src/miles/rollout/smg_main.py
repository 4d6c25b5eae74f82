"""``python -m miles.rollout.smg_main launch ...``: the ``smg`` router with the run's keys taken from the
environment (:data:`~miles.auth.API_KEY_ENV`, :data:`~miles.auth.ADMIN_API_KEY_ENV`) rather than the command
line, where every user of the host would read them (:func:`miles.rollout.router.smg_command` builds it)."""

from __future__ import annotations

import os
import sys

from miles.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, ServiceKeys
from miles.rollout.router import smg_key_flags

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    keys = ServiceKeys.from_env()
    for name in (API_KEY_ENV, ADMIN_API_KEY_ENV):  # smg's own children need no copy
        os.environ.pop(name, None)
    from smg.cli import main as smg_main

    smg_main(args + smg_key_flags(keys))


if __name__ == "__main__":
    main()
