"""``python -m miles.engine FLAGS``: one local engine process (what the ``local`` backend launches; the
same flags as ``miles serve``). Starts without the CLI application."""

from __future__ import annotations

from miles.engine.launch import main

if __name__ == "__main__":
    main()
