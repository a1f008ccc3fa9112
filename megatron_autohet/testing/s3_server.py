"""A real S3 endpoint for tests and benchmarks: moto's HTTP server on 127.0.0.1, so requests go
through boto3's whole stack (signing, HTTP, retries, multipart) as they would against AWS.

The server keeps everything in memory; tests share one server and bucket and stay independent by
each using its own prefix (the ``s3_uri`` fixture in tests/conftest.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from megatron_autohet.system.ports import free_port

BUCKET = "autohet-test"
ACCESS_KEY_ID = "testing"

# Dummy credentials, and nothing from the developer's ~/.aws (a profile, a region, an endpoint
# override or an instance-metadata lookup would change what boto3 does or make it slow).
ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
}
UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_ENDPOINT_URL",
         "AWS_ENDPOINT_URL_S3")


@contextmanager
def moto_s3_server(bucket: str = BUCKET) -> Iterator[tuple[str, str]]:
    """Start moto's server with dummy credentials in the environment, create ``bucket``, yield
    ``(endpoint_url, bucket)``; stop the server and restore the environment after."""
    # boto3, moto: the test extra, on first use
    import boto3
    from moto.server import ThreadedMotoServer

    saved_env = {name: os.environ.get(name) for name in (*ENVIRONMENT, *UNSET)}
    werkzeug = logging.getLogger("werkzeug")          # one log line per request otherwise
    saved_level = werkzeug.level
    os.environ.update(ENVIRONMENT)
    for name in UNSET:
        os.environ.pop(name, None)
    werkzeug.setLevel(logging.WARNING)
    try:
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            endpoint = f"http://127.0.0.1:{port}"
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            yield endpoint, bucket
        finally:
            server.stop()
    finally:
        werkzeug.setLevel(saved_level)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def seed_objects(bucket: str, objects: dict[str, bytes]) -> None:
    """Write objects straight into the running server's in-memory store (same process), for tests
    that need thousands of objects: each PUT over HTTP costs about 10 ms here."""
    # moto: the test extra, on first use
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for key, data in objects.items():
        backend.put_object(bucket, key, data)
