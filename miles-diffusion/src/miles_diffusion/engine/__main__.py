"""``python -m miles_diffusion.engine --model DIR --port P``: serve a diffusion policy."""

from __future__ import annotations

from miles_diffusion.engine.launch import main

if __name__ == "__main__":
    main()
