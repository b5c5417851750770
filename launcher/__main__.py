"""`python -m launcher` runs the CLI (used to start child processes)."""

from launcher.cli import main

main()
