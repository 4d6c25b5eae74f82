"""``python -m miles.engine ARGS`` is ``miles serve ARGS`` (what the ``local`` backend launches)."""

from __future__ import annotations

import sys

from miles.cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]])
