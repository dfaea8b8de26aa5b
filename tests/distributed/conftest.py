import pytest

from tests.distributed.second_host import second_host as _second_host


@pytest.fixture(scope="session")
def second_host():
    """Another host for multi-node tests: its own network namespace and address where the machine
    allows it, else this host (`.separate` tells; tests that need two addresses skip)."""
    with _second_host() as host:
        yield host
