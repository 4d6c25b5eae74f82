"""Miles' benchmark suite: run one as ``python -m benchmarks.NAME`` (or ``miles bench NAME``) from the
repository root; ``python -m benchmarks.run_all`` runs them all side by side."""
