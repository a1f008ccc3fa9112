"""The S3 tier of the checkpoint system: one copy of each committed step in an S3 bucket.

This is the only module in the project that imports boto3; everything else talks to S3 through
:class:`S3Store`, which just moves bytes (built by checkpoint/sources.py's ``object_store``, the
one factory of the object-store tier). Integrity is the caller's job: it checks what comes back
against the step's manifest (checksums of byte ranges), because an S3 endpoint that is not AWS may
not verify the checksums a client sends (moto's server, used by the tests, never does).

Layout, for ``--autohet-s3-uri s3://BUCKET/PREFIX`` (keys are relative to PREFIX, which may be
empty; the names are the local tier's, from :mod:`.manifest`, which are Megatron-LM's)::

    PREFIX/iter_0000004/__0_0.distcp           data files of step 4 (any names; uploaded first,
    PREFIX/iter_0000004/...                    multipart above the threshold)
    PREFIX/iter_0000004/autohet-manifest.json  commits step 4: uploaded last, exactly once
    PREFIX/latest_checkpointed_iteration.txt   "4": the newest committed step (overwritten)

Why the manifest goes last: S3 has no directory rename, so a step cannot appear atomically. A step
directory without its manifest is incomplete (a writer was preempted mid-upload) and is never
loaded; the manifest's PUT is the commit point.

Why ``IfNoneMatch='*'`` (:meth:`S3Store.put_bytes_if_absent`): the manifest is written once. If two
writers race for the same step (a preempted job and its replacement), S3 lets exactly one create
the object; the other gets 412 PreconditionFailed (or 409 ConditionalRequestConflict while the
first PUT is in flight) and loses cleanly instead of silently replacing a committed manifest.

Timeouts: a preemptible job must not hang for minutes on an unreachable endpoint, so the client
has short connect/read timeouts and at most 3 attempts per request ("standard" mode: exponential
backoff, retries on throttling and transient errors); an unreachable endpoint fails in seconds
with an :class:`S3Error`. (A resume tries the listing again for a minute more, then stops:
checkpoint/sources.py, checkpoint/recovery.py.)

Credentials come only from boto3's standard chain (environment, shared config/credentials files,
instance metadata); they are never arguments and never appear in messages.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from os import PathLike

import boto3
import boto3.exceptions
import botocore.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from megatron_autohet.checkpoint.manifest import MANIFEST_FILE, parse_step_dir_name, step_dir_name
from megatron_autohet.checkpoint.sources import StoreError
from megatron_autohet.errors import ConfigError

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IP_ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+")
_URI_ALLOWED = "s3://BUCKET or s3://BUCKET/PREFIX"
_BUCKET_ALLOWED = ("3-63 characters: lowercase letters, digits, '.' and '-', starting and ending "
                   "with a letter or digit, no '..', not an IP address")
# Answers to a conditional PUT that mean "the object is already there (or being written)".
_EXISTS = {"PreconditionFailed", "ConditionalRequestConflict"}
_ABSENT = {"NoSuchKey", "NotFound", "404"}
# Answers that mean the tier cannot work at all (not a passing outage)
_PERMANENT = {"NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
              "AllAccessDisabled", "InvalidBucketName", "403", "InvalidToken", "ExpiredToken"}


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/prefix``; prefix has no leading or trailing slash and may be empty."""

    bucket: str
    prefix: str

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def uri(self, relative: str = "") -> str:
        key = self.key(relative) if relative else self.prefix
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"


def parse_s3_uri(uri: str, flag: str = "--autohet-s3-uri") -> S3Location:
    """Parse ``s3://bucket[/prefix]`` (one trailing slash is ignored); ConfigError naming ``flag``
    for anything else, so a bad URI is caught at start-up and not after the first step trains."""
    if not uri.startswith("s3://"):
        raise ConfigError("<command line>", flag, f"{uri!r} is not an s3:// URI", _URI_ALLOWED)
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or _IP_ADDRESS.fullmatch(bucket):
        raise ConfigError("<command line>", flag, f"{bucket!r} in {uri!r} is not a valid bucket "
                          "name", _BUCKET_ALLOWED)
    prefix = prefix.removesuffix("/")
    if prefix and "" in prefix.split("/"):
        raise ConfigError("<command line>", flag, f"{uri!r} has an empty path segment",
                          _URI_ALLOWED)
    return S3Location(bucket, prefix)


class S3Error(StoreError):
    """An S3 operation failed (the object-store tier's StoreError, checkpoint/sources.py). The
    message names the operation, the ``s3://`` address and botocore's reason (error code and
    text, or the connection failure); no credentials. ``code`` is S3's error code
    (``NoSuchKey``...) when S3 answered, else None."""

    def __init__(self, operation: str, uri: str, reason: str, code: str | None = None):
        self.operation = operation
        self.uri = uri
        self.reason = reason
        self.code = code
        super().__init__(f"S3 {operation} {uri} failed: {reason}")

    @property
    def permanent(self) -> bool:
        return self.code in _PERMANENT


class S3Store:
    """One bucket/prefix. A single boto3 client is created here and shared: clients are
    thread-safe (sessions are not), so one store may serve several upload/download threads."""

    def __init__(self, uri: str, *, endpoint_url: str | None = None, region: str | None = None,
                 max_concurrency: int = 8, multipart_threshold: int = 8 * 2**20,
                 part_size: int = 8 * 2**20, connect_timeout: float = 5,
                 read_timeout: float = 60, attempts: int = 3):
        """``attempts``: of each request, in all (boto3's ``max_attempts``: the first and up to
        ``attempts - 1`` retries). ``part_size`` below S3's 5 MiB minimum is raised to it by
        boto3."""
        self.location = parse_s3_uri(uri)
        config = Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                        retries={"max_attempts": attempts, "mode": "standard"},
                        # one pooled connection per transfer thread, or threads wait for sockets
                        max_pool_connections=max(10, max_concurrency))
        session = boto3.session.Session(region_name=region)
        self._client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self._transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                        multipart_chunksize=part_size,
                                        max_concurrency=max_concurrency, use_threads=True)

    @contextmanager
    def _errors(self, operation: str, key: str) -> Iterator[None]:
        try:
            yield
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError,
                boto3.exceptions.Boto3Error) as exc:
            code = (exc.response.get("Error", {}).get("Code")
                    if isinstance(exc, botocore.exceptions.ClientError) else None)
            raise S3Error(operation, self.location.uri(key), str(exc), code) from exc

    def upload_file(self, local_path: str | PathLike, key: str, *,
                    progress: Callable[[int], object] | None = None) -> None:
        """Upload a file (multipart above the threshold, parts in parallel), sending SHA-256
        checksums. ``progress(n)`` gets each increment of bytes sent, from transfer threads."""
        with self._errors("upload", key):
            self._client.upload_file(str(local_path), self.location.bucket,
                                     self.location.key(key),
                                     ExtraArgs={"ChecksumAlgorithm": "SHA256"},
                                     Callback=progress, Config=self._transfer)

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if nothing is there; False when an object already exists (another
        writer won). A retried PUT whose first response was lost also reads as False, so a
        caller that must know whether its own bytes landed compares them with get_bytes."""
        try:
            with self._errors("conditional put", key):
                self._client.put_object(Bucket=self.location.bucket, Key=self.location.key(key),
                                        Body=data, IfNoneMatch="*", ChecksumAlgorithm="SHA256")
        except S3Error as exc:
            if exc.code in _EXISTS:
                return False
            raise
        return True

    def put_bytes_if_match(self, key: str, data: bytes, etag: str) -> bool:
        """Replace ``key`` only if it is still the object read with ``etag``; False when another
        writer replaced (or removed) it since (compare-and-swap: the writer lease)."""
        try:
            with self._errors("conditional put", key):
                self._client.put_object(Bucket=self.location.bucket, Key=self.location.key(key),
                                        Body=data, IfMatch=etag, ChecksumAlgorithm="SHA256")
        except S3Error as exc:
            if exc.code in _EXISTS or exc.code in _ABSENT:
                return False
            raise
        return True

    def get_bytes_and_etag(self, key: str) -> tuple[bytes, str] | None:
        """The whole object and its ETag (for :meth:`put_bytes_if_match`), or None."""
        try:
            with self._errors("get", key):
                response = self._client.get_object(Bucket=self.location.bucket,
                                                   Key=self.location.key(key))
                return response["Body"].read(), response["ETag"]
        except S3Error as exc:
            if exc.code in _ABSENT:
                return None
            raise

    def delete_key(self, key: str) -> None:
        with self._errors("delete", key):
            self._client.delete_object(Bucket=self.location.bucket, Key=self.location.key(key))

    def put_bytes(self, key: str, data: bytes) -> None:
        """Create or overwrite ``key`` (the latest pointer)."""
        with self._errors("put", key):
            self._client.put_object(Bucket=self.location.bucket, Key=self.location.key(key),
                                    Body=data, ChecksumAlgorithm="SHA256")

    def get_bytes(self, key: str) -> bytes | None:
        """The whole object, or None when there is none."""
        try:
            with self._errors("get", key):
                response = self._client.get_object(Bucket=self.location.bucket,
                                                   Key=self.location.key(key))
                return response["Body"].read()
        except S3Error as exc:
            if exc.code in _ABSENT:
                return None
            raise

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from offset ``start`` (one ranged GET); S3Error if fewer come back
        (the object is shorter than the manifest says)."""
        if start < 0 or length <= 0:
            raise ValueError(f"bad range start={start} length={length}: need start >= 0 and "
                             "length > 0")
        with self._errors("ranged get", key):
            response = self._client.get_object(Bucket=self.location.bucket,
                                               Key=self.location.key(key),
                                               Range=f"bytes={start}-{start + length - 1}")
            data = response["Body"].read()
        if len(data) != length:
            raise S3Error("ranged get", self.location.uri(key),
                          f"asked for {length} bytes at offset {start}, got {len(data)}")
        return data

    def list_steps(self) -> list[int]:
        """Iterations with an ``iter_XXXXXXX/`` directory, ascending, manifest or not."""
        base = self.location.key("")
        steps = []
        with self._errors("list", ""):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=base, Delimiter="/")
            for page in pages:
                for common in page.get("CommonPrefixes", []):
                    iteration = parse_step_dir_name(common["Prefix"][len(base):].rstrip("/"))
                    if iteration is not None:
                        steps.append(iteration)
        return sorted(steps)

    def steps_holding(self, name: str) -> list[int]:
        """Iterations whose ``iter_XXXXXXX/`` directory holds an object ``name``, ascending: one
        flat listing of the prefix (a request per 1000 objects), not a listing per step."""
        base = self.location.key("")
        steps = []
        with self._errors("list", ""):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=base)
            for page in pages:
                for obj in page.get("Contents", []):
                    step, _, rest = obj["Key"][len(base):].partition("/")
                    iteration = parse_step_dir_name(step) if rest == name else None
                    if iteration is not None:
                        steps.append(iteration)
        return sorted(steps)

    def list_files(self, iteration: int) -> dict[str, int]:
        """File name (relative to the step directory) -> size in bytes, for one step."""
        return {name: size for name, size, _ in self._objects(iteration)}

    def delete_step(self, iteration: int) -> None:
        """Delete a step's objects (keep-last-K retention). The manifest goes first, on its own,
        so the step is already incomplete, and never loaded, while its data files go."""
        objects = [key for name, _, key in self._objects(iteration) if name != MANIFEST_FILE]
        manifest = self.location.key(f"{step_dir_name(iteration)}/{MANIFEST_FILE}")
        self._delete(iteration, [manifest])
        for i in range(0, len(objects), 1000):          # DeleteObjects takes at most 1000 keys
            self._delete(iteration, objects[i:i + 1000])

    def _objects(self, iteration: int) -> Iterator[tuple[str, int, str]]:
        """(name relative to the step directory, size, full key) of each object of a step."""
        base = self.location.key(step_dir_name(iteration) + "/")
        with self._errors("list", step_dir_name(iteration) + "/"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=base)
            for page in pages:
                for obj in page.get("Contents", []):
                    yield obj["Key"][len(base):], obj["Size"], obj["Key"]

    def _delete(self, iteration: int, keys: list[str]) -> None:
        with self._errors("delete", step_dir_name(iteration) + "/"):
            response = self._client.delete_objects(
                Bucket=self.location.bucket,
                Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        if response.get("Errors"):
            error = response["Errors"][0]
            raise S3Error("delete", f"s3://{self.location.bucket}/{error['Key']}",
                          f"{error['Code']}: {error['Message']} ({len(response['Errors'])} of "
                          f"{len(keys)} objects not deleted)", error["Code"])
