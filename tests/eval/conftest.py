"""Fixtures for the lm-evaluation-harness tests: the server tests' tiny random checkpoint and real-server helpers."""

from tests.server.conftest import checkpoint  # noqa: F401  (a fixture)
