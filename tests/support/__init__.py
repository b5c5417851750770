"""Helpers shared by the test folders: real servers on loopback, the tiny tool model,
PostgreSQL databases, storage faults, chat templates, the output corpus. Importable as
`support.<module>` from any test because pytest puts tests/ on sys.path (the `pythonpath`
option in pyproject.toml); no test edits sys.path."""
