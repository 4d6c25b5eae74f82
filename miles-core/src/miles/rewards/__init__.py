"""Reward functions (built-in plugins) and the scoring helper that runs them with timeouts."""
