"""The driver: the RL loop (generate -> score -> advantages -> train -> push weights), the trainer-rank
worker that runs it, and the launch of engines and ranks behind ``miles train``."""
