"""The fault suite's PostgreSQL: a throwaway cluster each test may stop, start or kill."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from tests.faults.cluster import Cluster


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Cluster]:
    """A cluster of this session's own; one that cannot start fails under CI=true and
    skips elsewhere. Never the shared server on 5432, which other suites use."""
    try:
        cluster = Cluster()
    except Exception as exc:
        message = f"cannot create a throwaway PostgreSQL cluster: {exc}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        cluster.start()
    except Exception as exc:
        cluster.destroy()
        message = f"cannot start a throwaway PostgreSQL cluster: {exc}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    yield cluster
    cluster.destroy()


@pytest.fixture
def cluster(pg_cluster: Cluster) -> Cluster:
    """The session's cluster, running (a test that failed half-way may have left it down)."""
    if not pg_cluster.running():
        pg_cluster.start()
    return pg_cluster


@pytest.fixture
def fault_url(cluster: Cluster) -> str:
    """A backend URL with a schema of this test's own on the throwaway cluster."""
    return f"{cluster.dsn}?schema=f_{secrets.token_hex(6)}"
