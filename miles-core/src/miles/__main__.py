"""``python -m miles`` runs the CLI."""

from miles.cli import main

main()
