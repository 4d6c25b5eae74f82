"""The image engine: a server process that samples images with per-step log-probs (``python -m
miles_diffusion.engine``), reached over HTTP in SGLang's ``/generate`` shape, as the local engine is."""
