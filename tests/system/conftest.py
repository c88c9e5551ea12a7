"""System tests drive real nodes through the same `spawn` fixture as the integration tests."""

from tests.integration.conftest import spawn  # noqa: F401  (a fixture, used by name)
