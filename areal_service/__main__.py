"""`python -m areal_service` runs the CLI (used to start child processes)."""

from areal_service.cli import main

main()
