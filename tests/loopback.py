"""Compatibility alias for tests written before tests/support/ (tests/security imports
`loopback`): new tests import `support.loopback`; delete this once none imports `loopback`."""

from support.loopback import *  # noqa: F403
