"""``python -m miles_sglang.serve FLAGS``: ``python -m sglang.launch_server FLAGS`` with the run's keys.

The keys come from the environment (:data:`~miles.auth.API_KEY_ENV`, :data:`~miles.auth.ADMIN_API_KEY_ENV`)
and become SGLang's ``--api-key`` / ``--admin-api-key`` inside this process, so they are on no command line
that ``/proc`` or a launcher's log would show. SGLang 0.5.23 logs its resolved arguments, keys included, at
start: every log record of this process has the keys' values redacted. (SGLang also reports them in
``/server_info``, which its API key opens; Miles' engine client drops them from what it reads.)
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from typing import Any

from miles.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, ServiceKeys

__all__ = ["key_argv", "keyed_launch", "main"]

LAUNCH_MODULE = "sglang.launch_server"


def key_argv(keys: ServiceKeys) -> list[str]:
    """SGLang's flags for ``keys``: ``--api-key`` (every route; the ``NORMAL`` ones only with an admin key) and
    ``--admin-api-key`` (its ``ADMIN_OPTIONAL`` control routes)."""
    flags = ["--api-key", keys.api_key] if keys.api_key else []
    return flags + (["--admin-api-key", keys.admin_api_key] if keys.admin_api_key else [])


def keyed_launch(argv: list[str]) -> list[str]:
    """``argv`` (``python -m sglang.launch_server ...``, :func:`miles_sglang.command.launch_argv`) started
    through this module, which adds the keys from its environment."""
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] == "-m" and out[i + 1] == LAUNCH_MODULE:
            out[i + 1] = __name__
            return out
    raise ValueError(f"not an SGLang launch command: {argv[:4]}")


def _redact_records(secrets: list[str]) -> None:
    """Every log record created in this process shows ``<redacted>`` for each of ``secrets``."""
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot format is left to its handler
            return record
        if any(s in message for s in secrets):
            for s in secrets:
                message = message.replace(s, "<redacted>")
            record.msg, record.args = message, None
        return record

    logging.setLogRecordFactory(factory)


def main() -> None:
    keys = ServiceKeys.from_env()
    for name in (API_KEY_ENV, ADMIN_API_KEY_ENV):  # SGLang's own processes get them from its arguments
        os.environ.pop(name, None)
    if keys.enabled:
        _redact_records(keys.secrets())
    sys.argv = [LAUNCH_MODULE, *sys.argv[1:], *key_argv(keys)]
    runpy.run_module(LAUNCH_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
