"""Data sources: where prompts (and labels) come from."""
