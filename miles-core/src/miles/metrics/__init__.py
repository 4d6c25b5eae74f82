"""Metrics loggers (JSONL built in; TensorBoard and W&B as plugins) and the fidelity signals."""
