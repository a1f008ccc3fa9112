"""Checksums in the manifest: new steps record xxh3_128, steps of earlier versions (format
version 1, bare SHA-256) still read and verify, and every check dispatches on the algorithm a
digest names (one path for both)."""

from __future__ import annotations

import hashlib
import json

import pytest
import xxhash

from megatron_autohet.checkpoint.inspect import MISMATCH, TRUNCATED, file_problem, item_problem
from megatron_autohet.checkpoint.manifest import (FORMAT, FORMAT_VERSION, ItemRecord, Manifest,
                                                  checksum, matches)

pytestmark = pytest.mark.unit

DATA = bytes(range(256)) * 4


def _format_1(sha256_of_item: str) -> bytes:
    """A manifest as versions before xxh3_128 wrote it (one data file, one small file)."""
    return json.dumps({
        "format": FORMAT, "format_version": 1, "iteration": 4, "plan": {}, "extra": {},
        "files": [{"name": "__0_0.distcp", "size": len(DATA), "rank": 0, "node": "n",
                   "sha256": None},
                  {"name": "common.pt", "size": 3, "rank": 0, "node": "n",
                   "sha256": hashlib.sha256(b"abc").hexdigest()}],
        "items": [{"key": "w", "offsets": [0], "sizes": [len(DATA)], "file": "__0_0.distcp",
                   "offset": 0, "length": len(DATA), "sha256": sha256_of_item}],
        "replicas": []}).encode()


def test_new_digests_are_xxh3_128_named_by_algorithm():
    assert checksum(DATA) == f"xxh3_128:{xxhash.xxh3_128(DATA).hexdigest()}"
    assert matches(DATA, checksum(DATA))
    assert not matches(DATA[:-1] + b"\0", checksum(DATA))


def test_a_format_1_manifest_reads_as_sha256_digests_and_writes_the_current_format():
    manifest = Manifest.from_json(_format_1(hashlib.sha256(DATA).hexdigest()), "m.json")
    item = manifest.items[0]
    assert item.digest == f"sha256:{hashlib.sha256(DATA).hexdigest()}"
    assert manifest.files["__0_0.distcp"].digest is None                 # a data file
    assert manifest.files["common.pt"].digest == f"sha256:{hashlib.sha256(b'abc').hexdigest()}"
    written = json.loads(manifest.to_json())
    assert written["format_version"] == FORMAT_VERSION == 2
    assert written["items"][0]["digest"] == item.digest and "sha256" not in written["items"][0]
    assert Manifest.from_json(manifest.to_json(), "again") == manifest


@pytest.mark.parametrize("digest_of", [
    lambda raw: f"sha256:{hashlib.sha256(raw).hexdigest()}",     # a format-1 step's
    checksum,                                                    # a new step's
], ids=["sha256", "xxh3_128"])
def test_every_check_verifies_with_the_algorithm_its_digest_names(digest_of):
    item = ItemRecord(key="w", offsets=(0,), sizes=(len(DATA),), file="f", offset=0,
                      length=len(DATA), digest=digest_of(DATA))
    damaged = bytearray(DATA)
    damaged[len(DATA) // 2] ^= 0x10
    assert item_problem(item, DATA) is None
    assert item_problem(item, bytes(damaged)) == MISMATCH
    assert item_problem(item, DATA[:-1]) == TRUNCATED
    assert file_problem(DATA, len(DATA), digest_of(DATA)) is None
    assert file_problem(bytes(damaged), len(DATA), digest_of(DATA)) == MISMATCH


@pytest.mark.parametrize("change, says", [
    ({"format_version": 3}, "format 'megatron-autohet checkpoint' version 3"),
    ({"items": [{"key": "w", "offsets": None, "sizes": None, "file": "f", "offset": 0,
                 "length": 1, "digest": "md5:00"}]}, "checksum 'md5' (known: sha256, xxh3_128)"),
])
def test_an_unknown_version_or_checksum_is_one_error_naming_the_file(change, says):
    data = json.loads(Manifest(iteration=4, files={}, items=[], plan={}).to_json())
    with pytest.raises(ValueError) as err:
        Manifest.from_json(json.dumps({**data, **change}).encode(), "ckpt/m.json")
    assert str(err.value) == f"ckpt/m.json: not a readable {FORMAT} manifest ({says})"
