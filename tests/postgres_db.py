"""Compatibility alias for tests written before tests/support/ (tests/security imports
`postgres_db`): new tests import `support.postgres_db`; delete this once none imports `postgres_db`."""

from support.postgres_db import *  # noqa: F403
