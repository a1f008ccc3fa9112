"""An elastic job on an emulated spot fleet: preemption with notice, a node lost without notice,
a node joining - against an uninterrupted run.

Four nodes (each its own `autohet node` torchrun agent, `autohet watch` and local checkpoint
directory; megatron_autohet/elastic/emulate.py) train the tiny GPT with checkpoints every
``SAVE`` iterations to their disks and to S3 (moto). Then:

1. node2 gets an AWS spot interruption notice (its watcher polls a fake IMDSv2 server with the
   paths, token and body EC2 uses): the job saves the iteration
   it just finished, node2's files go to the survivors, node2 leaves, the survivors re-plan in
   their running processes and recover that very iteration - nothing lost;
2. node1 is killed with SIGKILL: the survivors restart from the last periodic save - at most
   ``SAVE`` iterations lost;
3. node4 joins: torchrun stops the workers (SIGTERM), they save the iteration they finished,
   the job re-plans with node4 and recovers it - nothing lost.

The proof: every iteration the job logged (re-trained ones included) has the loss and grad norm
of the uninterrupted run on the same global batches (relative 1e-6: another plan sums in another
order), consumed samples go 8, 16, ... without a gap, and the iterations lost are as above.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_metadata import FakeAws
from megatron_autohet.elastic.emulate import EmulatedFleet

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "configs/models/tiny.yaml"
CLUSTER = ROOT / "configs/clusters/spot-4.yaml"
ITERS, SAVE, REL = 40, 4, 1e-6
GPUS = {"node0": "A100-80GB", "node1": "A100-80GB", "node2": "H800", "node3": "H20"}


def autohet(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", *map(str, args)],
                          capture_output=True, text=True, **kwargs)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plan, the data cache, and the uninterrupted run's metrics by iteration."""
    tmp = tmp_path_factory.mktemp("reference")
    plan = tmp / "plan.yaml"
    done = autohet("plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", 8,
                   "--micro-batch-size", 1, "-o", plan)
    assert done.returncode == 0, done.stderr
    metrics = tmp / "metrics.jsonl"
    done = autohet("train", "--plan", plan, "--model", MODEL, "--iters", ITERS,
                   "--data-dir", tmp / "data", "--metrics-jsonl", metrics, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from megatron_autohet.elastic.emulate import read_jsonl
    return plan, tmp / "data", {r["iteration"]: r for r in read_jsonl(metrics)}


def test_s3_step_reads_the_newest_committed_manifest(s3_uri, s3_endpoint):
    """A restart with no step on any disk takes the plan of the newest step in S3 (a whole fleet
    replaced, or the local tier wiped as in scripts/bench_spot.py's baseline)."""
    from types import SimpleNamespace

    from megatron_autohet.checkpoint.manifest import MANIFEST_FILE, Manifest, step_dir_name
    from megatron_autohet.checkpoint.s3_store import S3Store
    from megatron_autohet.elastic.worker import _s3_step

    options = SimpleNamespace(s3_uri=s3_uri, s3_endpoint_url=s3_endpoint[0])
    assert _s3_step(options) is None
    store = S3Store(s3_uri, endpoint_url=s3_endpoint[0])
    for iteration in (4, 8):
        manifest = Manifest(iteration=iteration, files={}, items=[], plan={"saved_at": iteration})
        store.put_bytes(f"{step_dir_name(iteration)}/{MANIFEST_FILE}", manifest.to_json())
    store.put_bytes(f"{step_dir_name(12)}/some-file", b"an upload that never committed")
    assert _s3_step(options) == {"iteration": 8, "plan": {"saved_at": 8}}


def test_preemption_loss_and_join_match_an_uninterrupted_run(reference, tmp_path, s3_endpoint,
                                                             s3_uri):
    plan, data_dir, ref = reference
    fleet = EmulatedFleet(tmp_path / "job", train_args=[
        "--plan", str(plan), "--model", str(MODEL), "--cluster", str(CLUSTER),
        "--iters", str(ITERS), "--save-interval", str(SAVE), "--data-dir", str(data_dir),
        "--autohet-s3-uri", s3_uri, "--autohet-s3-endpoint-url", s3_endpoint[0]])
    with fleet, FakeAws() as imds:
        for node, gpu in GPUS.items():
            fleet.add(node, gpu, cloud=("aws", imds.url) if node == "node2" else None)
        fleet.wait_for(lambda: fleet.iteration() >= 3, timeout=300, what="iteration 3")

        # 1. a notice (AWS gives two minutes)
        imds.schedule_preemption("terminate", time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                            time.gmtime(time.time() + 120)))
        assert fleet.reclaim_when_left("node2", deadline_s=120)
        notice_stop = fleet.events("stop")[-1]
        assert notice_stop["leaving"] == ["node2"]
        fleet.wait_for(lambda: len(fleet.events("recovery")) >= 1 and
                       fleet.iteration() >= notice_stop["iteration"] + 3,
                       timeout=300, what="training after the notice")
        after_notice = fleet.events("recovery")[0]
        assert fleet.events("plan")[1].get("warm") is True        # no restart, no rendezvous

        # 2. a loss without notice
        fleet.kill("node1")
        fleet.wait_for(lambda: len(fleet.events("recovery")) >= 2 and
                       fleet.iteration() > fleet.events("recovery")[1]["iteration"] + 2,
                       timeout=300, what="training after the kill")
        after_kill = fleet.events("recovery")[1]

        # 3. a node joins
        fleet.add("node4", "H800")
        fleet.wait_for(lambda: len(fleet.events("recovery")) >= 3, timeout=300,
                       what="recovery after node4 joined")
        codes = fleet.wait_all(timeout=600)

    assert codes == {"node0": 0, "node3": 0, "node4": 0}
    fleets = [sorted(p["nodes"]) for p in fleet.events("plan")]
    fleets = [f for i, f in enumerate(fleets) if i == 0 or f != fleets[i - 1]]
    assert fleets == [["node0", "node1", "node2", "node3"], ["node0", "node1", "node3"],
                      ["node0", "node3"], ["node0", "node3", "node4"]]
    join_stop = fleet.events("stop")[-1]
    after_join = fleet.events("recovery")[2]

    # Iterations lost: none with a notice or a join, at most SAVE without notice.
    assert after_notice["iteration"] == notice_stop["iteration"]
    assert join_stop["reason"] == "signal" and join_stop["leaving"] == []
    assert after_join["iteration"] == join_stop["iteration"]
    # The kill is the one place the log may go back: from the last iteration trained to the save.
    # It does not when the kill lands before the iteration after a save is logged (nothing lost).
    records = fleet.metrics()
    drops = [(a["iteration"], b["iteration"] - 1) for a, b in zip(records, records[1:])
             if b["iteration"] <= a["iteration"]]
    assert len(drops) <= 1
    if drops:
        assert drops[0][1] == after_kill["iteration"]
    lost = drops[0][0] - drops[0][1] if drops else 0
    assert 0 <= lost <= SAVE
    # The chunks only node1 held came from S3 (no surviving disk had them).
    assert after_kill["bytes"]["s3"] > 0 and after_notice["bytes"]["s3"] == 0

    # Every logged iteration equals the uninterrupted run's; samples continue without a gap.
    assert records[-1]["iteration"] == ITERS
    last = {r["iteration"]: r for r in records}
    assert sorted(last) == list(range(1, ITERS + 1))
    assert all(last[i]["consumed_samples"] == 8 * i for i in last)
    diffs = [max(rel(r["lm_loss"], ref[r["iteration"]]["lm_loss"]),
                 rel(r["grad_norm"], ref[r["iteration"]]["grad_norm"])) for r in records]
    print(f"{len(records)} logged iterations, max relative difference {max(diffs):.2e}")
    assert max(diffs) <= REL
    assert len(records) - ITERS == lost                             # re-trained: only those lost
