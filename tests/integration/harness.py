"""Compatibility alias for branches written before tests/support/: `from harness import`
still finds the gateway harness. New tests import `support.harness`; delete this once
none imports `harness`."""

from support.harness import *  # noqa: F403
from support.harness import ADMIN_KEY, Gateway, run_gateway, stored_completions  # noqa: F401
