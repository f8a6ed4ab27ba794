"""A temporary Prefect API (prefect_test_harness), one per test session, for the flow tests that need one."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
