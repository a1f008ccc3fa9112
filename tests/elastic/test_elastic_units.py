"""The pure parts of elastic jobs: the fleet present as a cluster, workers -> plan ranks, GPU
names -> catalog types, which checkpoint files move off nodes that will not train, and the
refusals of `autohet train`'s elastic flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.elastic.fleet import (Member, fleet_cluster, gpu_type_of_device,
                                            plan_ranks)
from megatron_autohet.elastic.handover import NodeDisk, Transfer, transfers
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import load_plan
from megatron_autohet.spec.cluster import load_cluster
from megatron_autohet.spec.gpus import load_gpu_catalog

ROOT = Path(__file__).resolve().parents[2]
SPOT = ROOT / "configs/clusters/spot-4.yaml"
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"


@pytest.mark.unit
def test_fleet_cluster_takes_links_by_name_else_by_gpu_type():
    template = load_cluster(ROOT / "configs/clusters/local-4.yaml")
    members = [Member("h800", "H800", 0), Member("new-a", "A100-80GB", 0),
               Member("new-a", "A100-80GB", 1)]
    cluster = fleet_cluster(members, template)
    assert [(n.name, n.gpu, n.num_gpus) for n in cluster.nodes] == [
        ("h800", "H800", 1), ("new-a", "A100-80GB", 2)]
    a100 = template.node("a100")
    assert cluster.node("new-a").intra_node_bandwidth_gbs == a100.intra_node_bandwidth_gbs
    with pytest.raises(ConfigError, match="no node with GPU type T4"):
        fleet_cluster([Member("t", "T4", 0)], template)
    with pytest.raises(ConfigError, match="GPUs of two types"):
        fleet_cluster([Member("x", "H800", 0), Member("x", "H20", 1)], template)


@pytest.mark.integration
def test_plan_ranks_follow_node_and_gpu_not_torchrun_order():
    plan = load_plan(PLAN)                 # a100:0 a100:1 h800:0 h20:0 -> ranks 0..3
    members = [Member("h20", "H20", 0), Member("a100", "A100-80GB", 1),
               Member("spare", "H800", 0), Member("h800", "H800", 0),
               Member("a100", "A100-80GB", 0)]
    assert plan_ranks(plan, members) == [3, 1, None, 2, 0]
    with pytest.raises(ConfigError, match=r"plan ranks \[3\] are on GPUs no worker has"):
        plan_ranks(plan, members[1:])


@pytest.mark.unit
@pytest.mark.parametrize("device,expected", [
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA H800", "H800"), ("NVIDIA H20", "H20"),
    ("Tesla T4", "T4"), ("NVIDIA GeForce RTX 4090", "RTX-4090"),
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA GeForce GTX 1080", None)])
def test_gpu_type_of_device(device, expected):
    assert gpu_type_of_device(device, sorted(load_gpu_catalog())) == expected


@pytest.mark.unit
def test_transfers_move_only_what_no_receiver_holds_and_balance_receivers():
    step = {".metadata": 10, "common.pt": 5, "__0_0.distcp": 100, "__1_0.distcp": 80,
            "autohet-manifest.json": 7}
    disks = [NodeDisk(0, True, {8: {k: step[k] for k in (".metadata", "common.pt",
                                                       "__0_0.distcp", "autohet-manifest.json")}}),
             NodeDisk(1, True, {8: {k: step[k] for k in (".metadata", "common.pt",
                                                       "autohet-manifest.json")}}),
             NodeDisk(2, False, {8: dict(step), 4: {"__9_0.distcp": 1}}),
             NodeDisk(3, False, {8: {"replica_3.distcp": 60, **{k: step[k] for k in (
                 ".metadata", "common.pt", "autohet-manifest.json")}}})]
    assert transfers(disks) == [Transfer(2, 0, 8, "__1_0.distcp", 80),
                                Transfer(3, 1, 8, "replica_3.distcp", 60)]
    # No receiver has the step: the first receiver gets all of it, small files included.
    lost = [NodeDisk(0, True, {}), NodeDisk(1, False, {8: dict(step)})]
    assert sorted(t.name for t in transfers(lost)) == sorted(step)
    assert {t.dst for t in transfers(lost)} == {0}
    assert transfers([NodeDisk(0, True, {8: dict(step)})]) == []


@pytest.mark.unit
@pytest.mark.parametrize("flags,field,message", [
    (["--cluster", str(SPOT)], "--cluster", "given to a job that does not re-plan"),
    (["--autohet-notice-file", "n.json"], "--autohet-notice-file", "given without --elastic"),
    (["--elastic"], "--elastic", "not started by torchrun"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes", "got 0.0"),
])
def test_elastic_flags_are_refused_in_one_line(flags, field, message, capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert main(["train", "--plan", str(PLAN), "--model", str(MODEL), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"autohet train: error: <command line>: field '{field}': {message}"
                   + err[0].split(message, 1)[1]]


@pytest.mark.unit
def test_elastic_needs_a_cluster_and_a_local_tier(capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    assert main(["train", "--plan", str(PLAN), "--model", str(MODEL), "--elastic"]) == 2
    assert "field '--cluster': missing with --elastic" in capsys.readouterr().err
    assert main(["train", "--plan", str(PLAN), "--model", str(MODEL), "--elastic",
                 "--cluster", str(SPOT)]) == 2
    assert "field '--autohet-local-ckpt-dir': missing with --elastic" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("flags, minutes", [([], 10.0),
                                            (["--distributed-timeout-minutes", "0.5"], 0.5)])
def test_elastic_jobs_wait_ten_minutes_for_a_peer_by_default(flags, minutes, monkeypatch,
                                                              tmp_path):
    """Megatron-LM's 10 minutes, --elastic too: NCCL starts its communicators in the first
    iteration, recovery ends at different times per rank, a fast pipeline waits for a slow one
    in gradient sync (a 1-minute default failed such jobs); a short timeout is asked for."""
    import megatron_autohet.elastic.worker as worker_module

    given = []

    class Recorded:                  # the worker as the command builds it, not started
        def __init__(self, *, options, **kwargs):
            given.append(options)

        def run(self):
            return 0

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(worker_module, "ElasticWorker", Recorded)
    assert main(["train", "--plan", str(PLAN), "--model", str(MODEL), "--elastic", "--cluster",
                 str(SPOT), "--autohet-local-ckpt-dir", str(tmp_path / "{node}"),
                 "--save-interval", "4", *flags]) == 0
    assert [o.distributed_timeout_minutes for o in given] == [minutes]


@pytest.mark.unit
def test_node_identity_checks_the_gpu_type_against_the_jobs_catalog(monkeypatch):
    from megatron_autohet.elastic.worker import node_identity

    emulated = str(Path(__file__).resolve().parents[2] / "configs" / "emulated" / "gpus.yaml")
    monkeypatch.setenv("AUTOHET_NODE", "emu-1")
    monkeypatch.setenv("AUTOHET_GPU", "EMU-MID")
    assert node_identity(0, emulated) == ("emu-1", "EMU-MID")
    with pytest.raises(ConfigError, match="unknown GPU type 'EMU-MID'"):
        node_identity(0)                # the bundled catalog has no emulated types
