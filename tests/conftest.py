"""Shared fixtures."""

from __future__ import annotations

import socket
import uuid

import pytest

from megatron_autohet.testing.s3_server import moto_s3_server


@pytest.fixture(scope="session")
def s3_endpoint():
    """``(endpoint_url, bucket)`` of moto's S3 server: started once per session (start-up costs
    about a second), with dummy AWS credentials in the environment while it runs."""
    with moto_s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_uri(s3_endpoint) -> str:
    """A fresh ``s3://bucket/prefix`` for one test, so tests sharing the server are independent."""
    _, bucket = s3_endpoint
    return f"s3://{bucket}/test-{uuid.uuid4().hex}"


@pytest.fixture
def refused_url() -> str:
    """``http://127.0.0.1:PORT`` that refuses every connection while the test runs: a socket
    holds the port bound without listening, so no server started meanwhile can take it. (A port
    merely free when chosen could become a process group's store or another test's server, and
    an HTTP client connected to a server that never answers waits out its read timeout: an S3
    recovery test once waited 120 s that way.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


SIZES = ("unit", "integration", "e2e")          # pytest.ini describes each


def pytest_collection_modifyitems(config, items):
    """Every test is exactly one of unit / integration / e2e, so `-m unit` is the fast slice."""
    wrong = [f"{item.nodeid}: {marks or 'none'}" for item in items
             if len(marks := [m for m in SIZES if item.get_closest_marker(m)]) != 1]
    if wrong:
        raise pytest.UsageError("each test needs exactly one of the markers "
                                f"{', '.join(SIZES)}:\n  " + "\n  ".join(wrong))
