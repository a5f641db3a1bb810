"""Fixtures shared by the distributed tests."""

from __future__ import annotations

import pytest

from tests.distributed._s3 import start_moto


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on loopback, started once and stopped at the end; one bucket,
    `snapshots`. Yields the environment a client needs (endpoint, credentials)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server, env = start_moto()
    yield env
    server.stop()
