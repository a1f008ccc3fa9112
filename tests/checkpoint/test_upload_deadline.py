"""The S3 upload of a step before a preemption notice's deadline (checkpoint/upload.py,
checkpoint/deadline.py), through a real moto server behind a slow link (tests/helpers/
throttle.py): what cannot end before the deadline is not started, an upload still running when
the time is up is not waited for, and either leaves the step uncommitted, saying why. Each case
leans only on the link's bound (an upload cannot be faster than its bytes at the rate), never
on how fast the machine is.
"""

from __future__ import annotations

import time

import pytest

from helpers.dist_utils import run_on_ranks
from helpers.throttle import Throttle
from megatron_autohet.checkpoint.deadline import Deadline
from megatron_autohet.checkpoint.manifest import MANIFEST_FILE, FileRecord, ItemRecord, Manifest
from megatron_autohet.checkpoint.writer import SMALL_FILES

pytestmark = pytest.mark.integration

RATE = 32 * 1024            # bytes/s
RESERVE_S = 5.0


def _step(directory, sizes: dict[str, int]) -> Manifest:
    """Step 7 in ``directory``: rank 0's data files of ``sizes`` (one chunk each) and the small
    files."""
    directory.mkdir()
    files, items = {}, []
    for name, size in sizes.items():
        (directory / name).write_bytes(bytes(size))
        files[name] = FileRecord(name, size, 0, "node0")
        items.append(ItemRecord(f"w{len(items)}", None, None, name, 0, size, "-"))
    for name in SMALL_FILES:
        (directory / name).write_bytes(b"small")
        files[name] = FileRecord(name, 5, 0, "node0", "-")
    return Manifest(iteration=7, files=files, items=items, plan={})


def _upload(endpoint: str, s3_uri: str, directory, sizes: dict[str, int], seconds_left):
    """Upload the step through the slow link with ``seconds_left`` for copies (None: no
    deadline); (what upload_step returned, the step's keys in S3)."""
    def upload(rank, world):
        from megatron_autohet.checkpoint.s3_store import S3Store
        from megatron_autohet.checkpoint.upload import upload_step

        manifest = _step(directory, sizes)
        with Throttle(endpoint, RATE) as link:
            store = S3Store(s3_uri, endpoint_url=link.url)
            deadline = (None if seconds_left is None else
                        Deadline(time.time() + RESERVE_S + seconds_left, RESERVE_S))
            done = upload_step(store, manifest, directory, rank=0, keep=2,
                                      deadline=deadline)
        keys = sorted(S3Store(s3_uri, endpoint_url=endpoint).list_files(7))
        return done, keys
    return run_on_ranks(1, upload)[0]


def test_a_file_that_cannot_end_before_the_deadline_is_not_started(s3_endpoint, s3_uri,
                                                                     tmp_path):
    """The first file's upload measures the link; the second needs at that rate more than
    twice the time left, so it is skipped, and the small files after it with it."""
    endpoint, _ = s3_endpoint
    sizes = {"__0_0.distcp": 4096, "__0_1.distcp": 40 * RATE}
    done, keys = _upload(endpoint, s3_uri, tmp_path / "step", sizes, seconds_left=20)
    assert not done.committed and done.bytes == 4096
    assert [s.name for s in done.skipped] == ["__0_1.distcp", *SMALL_FILES]
    assert "MiB/s measured need" in done.skipped[0].why, done.skipped[0]
    assert all("a file before it was skipped" in s.why for s in done.skipped[1:])
    assert keys == ["__0_0.distcp"]                 # no manifest: the step is not in S3


def test_an_upload_running_at_the_deadline_is_left_behind(s3_endpoint, s3_uri, tmp_path):
    """Nothing measured yet: the first file starts; it needs 8 s on the link, 1 s is left."""
    endpoint, _ = s3_endpoint
    done, keys = _upload(endpoint, s3_uri, tmp_path / "step", {"__0_0.distcp": 8 * RATE},
                         seconds_left=1)
    assert not done.committed and done.bytes == 0
    assert [s.name for s in done.skipped] == ["__0_0.distcp", *SMALL_FILES]
    assert "still uploading when the time before the deadline was up" in done.skipped[0].why
    assert MANIFEST_FILE not in keys


@pytest.mark.parametrize("seconds_left", [None, 3600])
def test_a_step_that_fits_is_committed(s3_endpoint, s3_uri, tmp_path, seconds_left):
    endpoint, _ = s3_endpoint
    sizes = {"__0_0.distcp": 4096, "__0_1.distcp": 2048}
    done, keys = _upload(endpoint, s3_uri, tmp_path / "step", sizes, seconds_left)
    assert done.committed and done.skipped == [] and done.bytes == 6144 + 5 * len(SMALL_FILES)
    assert keys == sorted([*sizes, *SMALL_FILES, MANIFEST_FILE])
