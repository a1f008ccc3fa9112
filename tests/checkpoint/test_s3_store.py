"""The S3 tier over real HTTP (moto's server): bytes come back identical, whole or by range; the
manifest's conditional PUT lets only the first writer win; steps are listed and deleted; bad URIs
and unreachable endpoints give clear errors that carry no credentials."""

from __future__ import annotations

import base64
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest

from megatron_autohet.checkpoint.manifest import LATEST_FILE, MANIFEST_FILE, step_dir_name
from megatron_autohet.checkpoint.s3_store import S3Error, S3Location, S3Store, parse_s3_uri
from megatron_autohet.errors import ConfigError
from megatron_autohet.system.ports import free_port
from megatron_autohet.testing.s3_server import seed_objects

MiB = 2**20
FLAG = "--autohet-s3-uri"
URI_ALLOWED = "s3://BUCKET or s3://BUCKET/PREFIX"
BUCKET_ALLOWED = ("3-63 characters: lowercase letters, digits, '.' and '-', starting and ending "
                  "with a letter or digit, no '..', not an IP address")


@pytest.fixture
def store(s3_endpoint, s3_uri) -> S3Store:
    return S3Store(s3_uri, endpoint_url=s3_endpoint[0])


def head(endpoint: str, store: S3Store, key: str) -> dict:
    """HeadObject with the stored checksum, through a client of its own."""
    return boto3.client("s3", endpoint_url=endpoint).head_object(
        Bucket=store.location.bucket, Key=store.location.key(key), ChecksumMode="ENABLED")


def sha256_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def write_random(path, size: int):
    data = os.urandom(size)
    path.write_bytes(data)
    return data


# ---- URIs and names -------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("uri, bucket, prefix", [
    ("s3://bkt", "bkt", ""),
    ("s3://bkt/", "bkt", ""),
    ("s3://my.bucket-1/runs/gpt", "my.bucket-1", "runs/gpt"),
    ("s3://my.bucket-1/runs/gpt/", "my.bucket-1", "runs/gpt"),
])
def test_parse_s3_uri_accepts(uri, bucket, prefix):
    assert parse_s3_uri(uri) == S3Location(bucket, prefix)


@pytest.mark.e2e
@pytest.mark.parametrize("uri, message", [
    ("bkt/prefix", f"'bkt/prefix' is not an s3:// URI (allowed: {URI_ALLOWED})"),
    ("S3://bkt", f"'S3://bkt' is not an s3:// URI (allowed: {URI_ALLOWED})"),
    ("s3://", f"'' in 's3://' is not a valid bucket name (allowed: {BUCKET_ALLOWED})"),
    ("s3:///prefix", f"'' in 's3:///prefix' is not a valid bucket name "
                     f"(allowed: {BUCKET_ALLOWED})"),
    ("s3://ab", f"'ab' in 's3://ab' is not a valid bucket name (allowed: {BUCKET_ALLOWED})"),
    ("s3://My_Bucket/x", f"'My_Bucket' in 's3://My_Bucket/x' is not a valid bucket name "
                         f"(allowed: {BUCKET_ALLOWED})"),
    ("s3://bkt-", f"'bkt-' in 's3://bkt-' is not a valid bucket name (allowed: {BUCKET_ALLOWED})"),
    ("s3://a..b", f"'a..b' in 's3://a..b' is not a valid bucket name (allowed: {BUCKET_ALLOWED})"),
    ("s3://10.0.0.1", f"'10.0.0.1' in 's3://10.0.0.1' is not a valid bucket name "
                      f"(allowed: {BUCKET_ALLOWED})"),
    ("s3://" + "a" * 64, f"'{'a' * 64}' in 's3://{'a' * 64}' is not a valid bucket name "
                         f"(allowed: {BUCKET_ALLOWED})"),
    ("s3://bkt/a//b", f"'s3://bkt/a//b' has an empty path segment (allowed: {URI_ALLOWED})"),
])
def test_parse_s3_uri_refuses(uri, message):
    with pytest.raises(ConfigError) as info:
        parse_s3_uri(uri)
    assert str(info.value) == f"<command line>: field '{FLAG}': {message}"


@pytest.mark.e2e
def test_parse_s3_uri_names_the_given_flag():
    with pytest.raises(ConfigError) as info:
        parse_s3_uri("/local/dir", flag="--load")
    assert str(info.value) == ("<command line>: field '--load': '/local/dir' is not an s3:// URI "
                               f"(allowed: {URI_ALLOWED})")


@pytest.mark.unit
def test_store_refuses_a_bad_uri_before_any_request():
    with pytest.raises(ConfigError):
        S3Store("s3://Bad_Bucket", endpoint_url=f"http://127.0.0.1:{free_port()}")


@pytest.mark.unit
def test_location_keys():
    assert S3Location("bkt", "runs/a").key("iter_0000004/x") == "runs/a/iter_0000004/x"
    assert S3Location("bkt", "").key("iter_0000004/x") == "iter_0000004/x"
    assert S3Location("bkt", "runs/a").uri(LATEST_FILE) == f"s3://bkt/runs/a/{LATEST_FILE}"
    assert S3Location("bkt", "").uri() == "s3://bkt"


# ---- round trips ----------------------------------------------------------------------------

@pytest.mark.e2e
def test_small_file_round_trip_with_progress(s3_endpoint, store, tmp_path):
    data = write_random(tmp_path / "common.pt", 100_000)
    sent = []
    store.upload_file(tmp_path / "common.pt", "iter_0000004/common.pt", progress=sent.append)
    assert sum(sent) == len(data)
    assert head(s3_endpoint[0], store, "iter_0000004/common.pt")["ChecksumSHA256"] == \
        sha256_b64(data)
    assert store.get_bytes("iter_0000004/common.pt") == data
    assert store.get_range("iter_0000004/common.pt", 0, 10) == data[:10]
    assert store.list_files(4) == {"common.pt": len(data)}


@pytest.mark.e2e
def test_multipart_round_trip_and_ranges(s3_endpoint, s3_uri, tmp_path):
    store = S3Store(s3_uri, endpoint_url=s3_endpoint[0], multipart_threshold=5 * MiB,
                    part_size=5 * MiB, max_concurrency=3)
    size = 11 * MiB + 123                                    # parts of 5, 5 and 1 MiB + 123
    data = write_random(tmp_path / "__0_0.distcp", size)
    sent = []
    key = "iter_0000004/__0_0.distcp"
    store.upload_file(tmp_path / "__0_0.distcp", key, progress=sent.append)
    assert sum(sent) == size

    info = head(s3_endpoint[0], store, key)
    assert info["ETag"].endswith('-3"'), "uploaded in one piece, not in 3 parts"
    assert "ChecksumSHA256" in info

    assert store.get_bytes(key) == data
    for start, length in [(0, 1), (0, 4096), (size // 2, 1000), (size - 100, 100), (size - 1, 1),
                          (5 * MiB - 7, 20), (10 * MiB - 1, 2), (0, size)]:
        assert store.get_range(key, start, length) == data[start:start + length], (start, length)


@pytest.mark.e2e
def test_parallel_ranged_reads_share_one_store(store):
    data = os.urandom(300_000)
    store.put_bytes("iter_0000001/__1_0.distcp", data)
    pieces = [(start, min(7_000, len(data) - start)) for start in range(0, len(data), 7_000)]
    with ThreadPoolExecutor(8) as pool:
        got = pool.map(lambda p: store.get_range("iter_0000001/__1_0.distcp", *p), pieces)
        assert b"".join(got) == data


@pytest.mark.e2e
def test_get_range_refuses_short_and_bad_ranges(store):
    store.put_bytes("iter_0000001/x", b"0123456789")
    with pytest.raises(S3Error) as info:
        store.get_range("iter_0000001/x", 8, 5)
    assert str(info.value) == (f"S3 ranged get {store.location.uri('iter_0000001/x')} failed: "
                               "asked for 5 bytes at offset 8, got 2")
    with pytest.raises(S3Error) as info:
        store.get_range("iter_0000001/x", 10, 1)              # wholly past the end: 416
    assert info.value.code == "InvalidRange"
    with pytest.raises(ValueError):
        store.get_range("iter_0000001/x", 0, 0)
    with pytest.raises(ValueError):
        store.get_range("iter_0000001/x", -1, 1)


@pytest.mark.e2e
def test_put_bytes_if_absent_writes_once(s3_endpoint, store):
    key = f"iter_0000004/{MANIFEST_FILE}"
    assert store.put_bytes_if_absent(key, b'{"writer": 1}') is True
    assert store.put_bytes_if_absent(key, b'{"writer": 2}') is False
    assert store.get_bytes(key) == b'{"writer": 1}'
    assert head(s3_endpoint[0], store, key)["ChecksumSHA256"] == sha256_b64(b'{"writer": 1}')


@pytest.mark.e2e
def test_put_bytes_overwrites_and_missing_keys_are_none(s3_endpoint, store):
    assert store.get_bytes(LATEST_FILE) is None
    store.put_bytes(LATEST_FILE, b"4")
    store.put_bytes(LATEST_FILE, b"8")
    assert store.get_bytes(LATEST_FILE) == b"8"
    assert head(s3_endpoint[0], store, LATEST_FILE)["ChecksumSHA256"] == sha256_b64(b"8")
    assert store.get_bytes("iter_0000004/nope") is None


# ---- steps ----------------------------------------------------------------------------------

def populate(store: S3Store, steps) -> None:
    for it in steps:
        for name in ("__0_0.distcp", ".metadata", MANIFEST_FILE):
            store.put_bytes(f"{step_dir_name(it)}/{name}", name.encode() * it)
    store.put_bytes(LATEST_FILE, str(max(steps)).encode())
    store.put_bytes("iter_abc/x", b"")                       # not a step directory
    store.put_bytes("logs/iter_0000999/x", b"")              # nested: not a step of this prefix


@pytest.mark.e2e
def test_list_and_delete_steps(store):
    assert store.list_steps() == []
    populate(store, [4, 100, 12])
    assert store.list_steps() == [4, 12, 100]
    assert store.list_files(12) == {"__0_0.distcp": 12 * 12, ".metadata": 9 * 12,
                                    MANIFEST_FILE: 21 * 12}
    assert store.list_files(5) == {}

    deleted = []
    store._client.meta.events.register(
        "provide-client-params.s3.DeleteObjects",
        lambda params, **_: deleted.append([o["Key"] for o in params["Delete"]["Objects"]]))
    store.delete_step(12)
    step = store.location.key(step_dir_name(12))
    assert deleted == [[f"{step}/{MANIFEST_FILE}"],            # first: the step is incomplete
                       [f"{step}/.metadata", f"{step}/__0_0.distcp"]]
    assert store.list_steps() == [4, 100]
    assert store.list_files(12) == {}
    assert store.list_files(4) == {"__0_0.distcp": 12 * 4, ".metadata": 9 * 4,
                                   MANIFEST_FILE: 21 * 4}
    store.delete_step(100)
    store.delete_step(100)                                   # nothing left: no error
    assert store.list_steps() == [4]
    assert store.get_bytes(LATEST_FILE) == b"100"           # the pointer is the caller's job


@pytest.mark.e2e
def test_steps_holding_a_file_in_one_listing(store):
    populate(store, [4, 100, 12])
    store.put_bytes(f"{step_dir_name(7)}/.metadata", b"x")          # no manifest: not committed
    store.put_bytes(f"{step_dir_name(9)}/sub/{MANIFEST_FILE}", b"x")  # not at the step's top
    calls = []
    store._client.meta.events.register("before-call.s3.*",
                                       lambda model, **_: calls.append(model.name))
    assert store.steps_holding(MANIFEST_FILE) == [4, 12, 100]
    assert calls == ["ListObjectsV2"]
    assert store.steps_holding(".metadata") == [4, 7, 12, 100]
    assert store.steps_holding("nope") == []


@pytest.mark.e2e
def test_steps_at_the_bucket_root(s3_endpoint):
    endpoint, _ = s3_endpoint
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="autohet-root")
    store = S3Store("s3://autohet-root", endpoint_url=endpoint)
    populate(store, [3, 7])
    assert store.list_steps() == [3, 7]
    assert store.get_bytes(LATEST_FILE) == b"7"
    assert store.steps_holding(MANIFEST_FILE) == [3, 7]
    store.delete_step(3)
    assert store.list_steps() == [7]


@pytest.mark.e2e
def test_listing_and_deleting_page_past_1000_objects(store):
    names = [f"{i:05d}.distcp" for i in range(1001)]
    seed_objects(store.location.bucket,
                 {store.location.key(f"iter_0000002/{n}"): b"x" for n in names})
    store.put_bytes("iter_0000003/a", b"x")
    calls = []
    store._client.meta.events.register("before-call.s3.*",
                                       lambda model, **_: calls.append(model.name))
    assert store.list_files(2) == dict.fromkeys(names, 1)
    assert calls == ["ListObjectsV2"] * 2                     # two pages: 1000 + 1
    calls.clear()
    store.delete_step(2)
    # the manifest, then the 1001 data files: at most 1000 keys a batch
    assert calls == ["ListObjectsV2"] * 2 + ["DeleteObjects"] * 3
    assert store.list_steps() == [3]


# ---- failures -------------------------------------------------------------------------------

SECRET_ID = "AKIAAUTOHETTESTKEY42"
SECRET_KEY = "autohet/secret+access+key/value"


def assert_no_secrets(err: Exception):
    for text in (str(err), repr(err)):
        assert SECRET_ID not in text and SECRET_KEY not in text


@pytest.mark.e2e
def test_unreachable_endpoint_fails_clearly(monkeypatch, tmp_path, refused_url):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRET_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    endpoint = refused_url
    store = S3Store("s3://autohet-test/run", endpoint_url=endpoint, connect_timeout=1, attempts=1)
    (tmp_path / "f").write_bytes(b"data")
    calls = [("upload", "iter_0000004/f", lambda: store.upload_file(tmp_path / "f",
                                                                      "iter_0000004/f")),
             ("conditional put", "iter_0000004/m", lambda: store.put_bytes_if_absent(
                 "iter_0000004/m", b"{}")),
             ("get", LATEST_FILE, lambda: store.get_bytes(LATEST_FILE)),
             ("ranged get", "iter_0000004/f", lambda: store.get_range("iter_0000004/f", 0, 4)),
             ("list", "", store.list_steps)]
    for operation, key, call in calls:
        with pytest.raises(S3Error) as info:
            call()
        uri = "s3://autohet-test/run" + (f"/{key}" if key else "")
        assert str(info.value).startswith(f"S3 {operation} {uri} failed: "), str(info.value)
        assert f"Could not connect to the endpoint URL: \"{endpoint}/" in str(info.value)
        assert info.value.code is None
        assert_no_secrets(info.value)


@pytest.mark.e2e
def test_s3_answers_become_s3_errors_without_secrets(monkeypatch, s3_endpoint):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRET_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    store = S3Store("s3://no-such-bucket/run", endpoint_url=s3_endpoint[0])
    with pytest.raises(S3Error) as info:
        store.put_bytes(LATEST_FILE, b"4")
    assert info.value.code == "NoSuchBucket"
    assert str(info.value) == (f"S3 put s3://no-such-bucket/run/{LATEST_FILE} failed: An error "
                               "occurred (NoSuchBucket) when calling the PutObject operation: "
                               "The specified bucket does not exist")
    assert_no_secrets(info.value)
