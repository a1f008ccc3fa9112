"""The writer lease on a directory and on an S3 prefix (moto's server over HTTP): one live owner,
its own job re-takes it, stale and known-dead holders give way, a take-over is explicit, a holder
that was taken over finds out, and a release removes only its own record."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from megatron_autohet.checkpoint.lease import (LEASE_FILE, DirectorySlot, Holder, Lease, LeaseHeld,
                                               LeaseLost, ObjectStoreSlot)
from megatron_autohet.checkpoint.s3_store import S3Store

pytestmark = pytest.mark.unit


@pytest.fixture(params=["directory", "s3"])
def slot_factory(request, tmp_path):
    """A function returning a fresh handle on one lease location, of each kind."""
    if request.param == "directory":
        return lambda: DirectorySlot(tmp_path / "ckpt")
    endpoint = request.getfixturevalue("s3_endpoint")
    uri = request.getfixturevalue("s3_uri")
    return lambda: ObjectStoreSlot(S3Store(uri, endpoint_url=endpoint[0]))


def test_a_second_owner_is_refused_naming_the_live_one(slot_factory):
    first = Lease([slot_factory()], "job-a")
    first.take()
    with pytest.raises(LeaseHeld) as refused:
        Lease([slot_factory()], "job-b").take()
    assert refused.value.holder.owner == "job-a"
    assert "job-a" in str(refused.value) and "--autohet-take-over-ckpt" in refused.value.allowed()
    Lease([slot_factory()], "job-a").take()          # the same job (a restart, another rank)


def test_a_stale_lease_is_free_and_its_old_holder_learns_it_lost(slot_factory):
    old = Lease([slot_factory()], "job-a", stale_s=0.2)
    old.take()
    time.sleep(0.5)
    Lease([slot_factory()], "job-b").take()
    with pytest.raises(LeaseLost) as lost:
        old.refresh()
    assert lost.value.holder.owner == "job-b"
    with pytest.raises(LeaseLost):
        old.check()


def test_take_over_is_explicit(slot_factory):
    Lease([slot_factory()], "job-a").take()
    Lease([slot_factory()], "job-b").take(take_over=True)
    holder, _ = slot_factory().read()
    assert holder.owner == "job-b"


def test_release_removes_only_its_own_lease(slot_factory):
    a = Lease([slot_factory()], "job-a", stale_s=0.2)
    a.take()
    time.sleep(0.5)
    b = Lease([slot_factory()], "job-b")
    b.take()
    a.release()                                     # taken over: not a's to remove
    assert slot_factory().read()[0].owner == "job-b"
    b.release()
    assert slot_factory().read() == (None, None)


def test_a_holder_whose_process_is_gone_on_this_host_is_dead(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    slot = DirectorySlot(tmp_path)
    dead = Holder.me("job-a", stale_s=3600)
    dead = Holder(**{**dead.__dict__, "pid": int(gone.stdout)})
    assert slot.create(dead)
    assert dead.known_dead()
    Lease([DirectorySlot(tmp_path)], "job-b").take()
    assert json.loads((tmp_path / LEASE_FILE).read_bytes())["owner"] == "job-b"


def test_all_or_nothing_over_several_locations(tmp_path):
    Lease([DirectorySlot(tmp_path / "b")], "job-a").take()
    with pytest.raises(LeaseHeld):
        Lease([DirectorySlot(tmp_path / "a"), DirectorySlot(tmp_path / "b")], "job-b").take()
    assert not (tmp_path / "a" / LEASE_FILE).exists()   # what it had created is given back


def test_the_heartbeat_keeps_it_fresh_and_notices_a_take_over(tmp_path):
    lease = Lease([DirectorySlot(tmp_path)], "job-a", stale_s=60, refresh_s=0.5)
    lease.take()
    first = DirectorySlot(tmp_path).read()[0].heartbeat
    lease.start_heartbeat()
    deadline = time.monotonic() + 60
    while DirectorySlot(tmp_path).read()[0].heartbeat == first:
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.05)
    Lease([DirectorySlot(tmp_path)], "job-b").take(take_over=True)
    while lease.lost is None:
        assert time.monotonic() < deadline, "the take-over went unnoticed"
        time.sleep(0.05)
    lease.release()
    assert DirectorySlot(tmp_path).read()[0].owner == "job-b"


def test_a_heartbeat_never_writes_over_a_take_over(tmp_path, monkeypatch):
    """The take-over lands between the heartbeat's read of its own record and its write
    (injected where the heartbeat stages the record it will write, a window of two fsyncs that
    a busy disk makes long): the heartbeat finds the lease lost and the new owner keeps it.
    Unlocked, the heartbeat's rename put job-a back over job-b, and both went on writing."""
    lease = Lease([DirectorySlot(tmp_path)], "job-a")
    lease.take()
    staged, taken_over = DirectorySlot._staged, []

    def stage_then_take_over(self, holder):
        path = staged(self, holder)
        if holder.owner == "job-a" and not taken_over:
            taken_over.append(True)
            Lease([DirectorySlot(tmp_path)], "job-b").take(take_over=True)
        return path
    monkeypatch.setattr(DirectorySlot, "_staged", stage_then_take_over)
    with pytest.raises(LeaseLost):
        lease.refresh()
    assert taken_over and DirectorySlot(tmp_path).read()[0].owner == "job-b"


def test_a_torn_record_is_free(tmp_path):
    (tmp_path / LEASE_FILE).write_bytes(b"{not json")
    Lease([DirectorySlot(tmp_path)], "job-b").take()
    assert DirectorySlot(tmp_path).read()[0].owner == "job-b"
