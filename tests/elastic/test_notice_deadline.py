"""A preemption notice's deadline drives the emergency path: 30 s between the
notice and the machine going, and a link to S3 (a real moto server behind a throttle) on which
the state needs longer than that. The background upload of the save before is given up, the
leaving node's files go to the node that stays first; S3, not needed then, is skipped and said;
the node is gone before its deadline, never mid-upload; the node that stays goes on in-process
from that very iteration.

Before, the stop waited for the background upload, then the stop's save uploaded to S3 first:
the machine went mid-upload, before the evacuation, with nothing of that iteration committed
anywhere but on a disk that was gone.
"""

from __future__ import annotations

import signal
import time

import pytest

from helpers.fleets import fleet_of, make_plan
from helpers.throttle import Throttle
from megatron_autohet.checkpoint.inspect import newest_manifest, s3_files
from megatron_autohet.checkpoint.manifest import MANIFEST_FILE, read_manifest, step_dir_name
from megatron_autohet.checkpoint.s3_store import S3Store
from megatron_autohet.elastic.hold import HOLD_FILE_ENV, hold_after
from megatron_autohet.elastic.notices import read_notice
from megatron_autohet.testing.s3_server import moto_s3_server

pytestmark = pytest.mark.e2e

RATE = 16 * 1024            # bytes/s to S3: a state of about 1 MiB needs a minute
WINDOW_S = 30               # the emulated watcher's --signal-grace


def test_a_deadline_shorter_than_the_upload_evacuates_and_skips_s3(tmp_path, monkeypatch):
    iters, saved_at, notice_at = 6, 2, 3
    gpus = {"node0": "A100-80GB", "node2": "H800"}
    hold = tmp_path / "hold"
    hold_after(hold, notice_at)
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    with moto_s3_server() as (endpoint, bucket), Throttle(endpoint, RATE) as link:
        s3_uri = f"s3://{bucket}/deadline"
        # The save of iteration 2 is still uploading in the background at the notice.
        fleet = fleet_of(tmp_path, make_plan(tmp_path), iters, saved_at)
        fleet.train_args += ["--autohet-s3-uri", s3_uri, "--autohet-s3-endpoint-url", link.url,
                             "--async-save"]
        with fleet:
            for node, gpu in gpus.items():
                fleet.add(node, gpu)
            fleet.wait_for(lambda: fleet.iteration() >= notice_at, timeout=600,
                           what=f"iteration {notice_at}")
            leaving = fleet.events("first_iteration")[0]["reported_by"]     # the plan's rank 0
            staying = next(n for n in gpus if n != leaving)
            written = f"successfully saved checkpoint from iteration {saved_at:7d}"
            fleet.wait_for(lambda: written in fleet.workdir.joinpath(f"{leaving}.log").read_text(),
                           timeout=60, what=f"iteration {saved_at} written, its upload begun")
            fleet.nodes[leaving].watcher.send_signal(signal.SIGTERM)
            fleet.wait_for(lambda: fleet.notice_file(leaving).exists(), timeout=60,
                           what=f"{leaving}'s notice file")
            notice = read_notice(fleet.notice_file(leaving))
            assert notice.seconds_to_deadline == pytest.approx(WINDOW_S)
            hold_after(hold, None)
            # The machine goes at the notice's deadline, whatever its processes are doing.
            left = fleet.reclaim_when_left(leaving,
                                           deadline_s=notice.deadline_unix - time.time())
            link.rate = None            # the staying node's own saves need no slow link
            assert left, fleet.tail(leaving, 60)
            codes = fleet.wait_all(timeout=600)
            # The leaving node's step: on the disk of the node that stays, not in S3.
            _, manifest = newest_manifest(str(fleet.workdir / staying / "ckpt"))
            in_s3 = S3Store(s3_uri, endpoint_url=endpoint).list_steps()

    # What the test stands on: the step's S3 upload needs more than twice the window.
    step = read_manifest(fleet.workdir / leaving / "ckpt" / step_dir_name(notice_at))
    assert sum(step.files[name].size for name in s3_files(step)) / RATE > 2 * WINDOW_S
    assert codes == {staying: 0}
    assert manifest.iteration == iters and saved_at not in in_s3 and notice_at not in in_s3
    assert (f"upload of iteration {saved_at} to {s3_uri} given up: a preemption notice's stop "
            "came first") in fleet.workdir.joinpath(f"{leaving}.log").read_text()
    events = fleet.events()
    after = events[next(i for i, e in enumerate(events) if e["event"] == "stop"):]
    assert [(e["event"], e["reported_by"]) for e in after] == [
        ("stop", leaving), ("saved", leaving), ("evacuate", leaving), ("upload", leaving),
        ("fleet", staying), ("plan", staying), ("recovery", staying),
        ("first_iteration", staying), ("finished", staying)], after
    stop, saved_event, evacuate, upload, _, plan, recovery, _, finished = after
    assert stop["iteration"] == notice_at and stop["deadline_unix"] == notice.deadline_unix
    for event in (stop, saved_event, evacuate, upload):
        assert 0 < event["to_deadline_s"] <= WINDOW_S, event
    assert evacuate["bytes"] > 0 and evacuate["skipped"] == []
    assert upload["needed"] is False and upload["committed"] is False
    assert plan["warm"] is True and plan["nodes"] == [staying]
    assert recovery["iteration"] == notice_at and finished["iteration"] == iters


def test_when_no_node_stays_s3_gets_what_fits_and_the_rest_is_said(tmp_path, monkeypatch):
    """Both nodes get a notice at once: the step exists nowhere else, so S3 is needed, but on
    the slow link its first file cannot end in the window. Each node stops waiting for it when
    the time for copies is up, says so, and is gone before its deadline; S3 keeps the step saved
    before, complete, as its newest."""
    iters, saved_at, notice_at = 6, 2, 3
    gpus = {"node0": "A100-80GB", "node2": "H800"}
    hold = tmp_path / "hold"
    hold_after(hold, notice_at)
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    with moto_s3_server() as (endpoint, bucket), Throttle(endpoint, None) as link:
        s3_uri = f"s3://{bucket}/everyone"
        fleet = fleet_of(tmp_path, make_plan(tmp_path), iters, saved_at)
        fleet.train_args += ["--autohet-s3-uri", s3_uri, "--autohet-s3-endpoint-url", link.url]
        with fleet:
            for node, gpu in gpus.items():
                fleet.add(node, gpu)
            # Held after iteration 3: the (synchronous) save of iteration 2 is in S3.
            fleet.wait_for(lambda: fleet.iteration() >= notice_at, timeout=600,
                           what=f"iteration {notice_at}")
            link.rate = RATE
            for node in gpus:
                fleet.nodes[node].watcher.send_signal(signal.SIGTERM)
            for node in gpus:
                fleet.wait_for(lambda: fleet.notice_file(node).exists(), timeout=60,
                               what=f"{node}'s notice file")
            deadline = min(read_notice(fleet.notice_file(n)).deadline_unix for n in gpus)
            hold_after(hold, None)
            left = {node: fleet.reclaim_when_left(node, deadline_s=deadline - time.time())
                    for node in gpus}
            assert left == {node: True for node in gpus}, [fleet.tail(n, 60) for n in gpus]
            store = S3Store(s3_uri, endpoint_url=endpoint)
            steps = store.list_steps()
            in_s3 = store.get_bytes(f"{step_dir_name(notice_at)}/{MANIFEST_FILE}")

    assert steps == [saved_at] and in_s3 is None
    stop, saved, evacuate, upload = fleet.events()[-4:]
    assert [e["event"] for e in (stop, saved, evacuate, upload)] == [
        "stop", "saved", "evacuate", "upload"]
    assert stop["leaving"] == sorted(gpus) and stop["iteration"] == notice_at
    assert evacuate["bytes"] == 0                    # no node to receive
    assert upload["needed"] is True and upload["committed"] is False
    # Every rank's files are named; each rank's first one was left running at the time limit.
    step = read_manifest(fleet.workdir / "node0" / "ckpt" / step_dir_name(notice_at))
    assert sorted(upload["skipped"]) == sorted(s3_files(step))
    log = "\n".join(fleet.workdir.joinpath(f"{n}.log").read_text() for n in gpus)
    assert "still uploading when the time before the deadline was up" in log
    for event in (stop, saved, evacuate, upload):
        assert 0 < event["to_deadline_s"] <= WINDOW_S, event
