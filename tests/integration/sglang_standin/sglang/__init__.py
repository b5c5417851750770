"""A CPU stand-in for the `sglang` package, for tests only: `python -m
sglang.launch_server` runs the project's local engine (same HTTP protocol). Put this
folder on PYTHONPATH of the process that launches servers; never install it."""
