"""Rollout: engines (launched by a rollout-engine backend), the client that talks to them, the rollout
manager that turns prompts into scored sample groups, and custom rollout functions."""
