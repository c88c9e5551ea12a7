"""Hostile peers are stock hivemind peers in processes of their own; honest nodes come from `spawn`."""

from tests.integration.conftest import spawn  # noqa: F401  (a fixture, used by name)
