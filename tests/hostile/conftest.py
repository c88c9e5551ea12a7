"""Hostile peers are stock hivemind peers in processes of their own; honest nodes come from `spawn`."""

from tests.integration.conftest import spawn  # noqa: F401  (a fixture, used by name)
from tests.integration.test_butterfly import trio  # noqa: F401  (a fixture: three butterfly peers in this process)
