"""Recovery on a fleet across zones (pure): the peers of a rank's own zone are asked before
those of another zone of its region, before those of another region, before S3; a chunk only S3
holds is downloaded once per zone and forwarded inside it; the bytes crossing zones and their
egress dollars, by hand."""

from __future__ import annotations

import shutil

import pytest

from megatron_autohet.checkpoint.manifest import ItemRecord
from megatron_autohet.checkpoint.recovery import RecoveryReport
from megatron_autohet.checkpoint.recovery_plan import ZoneTraffic, assign_sources, zone_traffic
from megatron_autohet.checkpoint.sources import OWN, PEER, S3, RankPlaces
from megatron_autohet.spec.cluster import cluster_from_dict

# one GPU per node; zones a1, a2 in region r1, zone b1 in region r2; prices by hand:
# a1 <-> a2 $0.01/GB (inter_zone), a* <-> b1 $0.02/GB (inter_region)
FLEET = cluster_from_dict({
    "name": "three-zones", "inter_node_bandwidth_gbs": 25,
    "zones": {"a1": "r1", "a2": "r1", "b1": "r2"},
    "links": {"inter_zone": {"egress_usd_per_gb": 0.01},
              "inter_region": {"egress_usd_per_gb": 0.02}},
    "nodes": [{"name": n, "gpu": "A100-80GB", "gpus": 1, "zone": z}
              for n, z in [("n0", "a1"), ("n1", "b1"), ("n2", "a2"), ("n3", "a1"),
                           ("n4", "b1")]]})
PLACES = RankPlaces(FLEET, ("n0", "n1", "n2", "n3", "n4"))    # rank i on node ni


def _chunk(key: str, file: str, length: int) -> ItemRecord:
    return ItemRecord(key, (0,), (length,), file, 0, length, "xxh3_128:" + "0" * 32)


def _plan(items, present, needed, places, s3=True):
    return [(f.rank, f.index, f.source, f.peer)
            for f in assign_sources(items, [], needed, present, s3, places=places)]


@pytest.mark.unit
def test_the_same_zones_peers_first_then_the_regions_then_the_others():
    items = [_chunk("w", "w.distcp", 10**9)]
    # rank 3 (zone a1) needs chunk 0, which ranks 1 (b1), 2 (a2) and 0 (a1) hold
    present = {0: {"w.distcp"}, 1: {"w.distcp"}, 2: {"w.distcp"}, 3: set(), 4: set()}
    assert _plan(items, present, {3: [0]}, PLACES) == [(3, 0, PEER, 0)]      # its zone
    assert _plan(items, present, {3: [0]}, None) == [(3, 0, PEER, 0)]        # lowest rank
    del present[0]
    assert _plan(items, present, {3: [0]}, PLACES) == [(3, 0, PEER, 2)]      # its region
    assert _plan(items, present, {3: [0]}, None) == [(3, 0, PEER, 1)]        # lowest rank
    present[2] = set()
    assert _plan(items, present, {3: [0]}, PLACES) == [(3, 0, PEER, 1)]      # another region
    # rank 4 (b1) takes rank 1's copy, inside its zone, before any in region r1
    present = {0: {"w.distcp"}, 1: {"w.distcp"}, 2: set(), 3: set(), 4: set()}
    assert _plan(items, present, {4: [0]}, PLACES) == [(4, 0, PEER, 1)]
    # the zone comes before the bytes already assigned: without zones rank 3 takes the peer
    # with the fewest bytes so far (rank 1, in b1), with them its own zone's rank 0, which
    # already sends the chunk to rank 2
    present = {0: {"w.distcp"}, 1: {"w.distcp"}, 2: set(), 3: set(), 4: set()}
    assert _plan(items, present, {2: [0], 3: [0]}, None) == [(2, 0, PEER, 0), (3, 0, PEER, 1)]
    assert _plan(items, present, {2: [0], 3: [0]}, PLACES) == [(2, 0, PEER, 0), (3, 0, PEER, 0)]


@pytest.mark.unit
def test_a_chunk_only_s3_holds_is_downloaded_once_per_zone():
    items = [_chunk("w", "w.distcp", 100)]
    present = {r: set() for r in range(5)}
    needed = {r: [0] for r in range(5)}
    # without zones: rank 0 downloads it for everyone
    assert _plan(items, present, needed, None) == [(0, 0, S3, None)] + [
        (r, 0, S3, 0) for r in range(1, 5)]
    # with zones: the lowest rank of each zone downloads it for its zone
    assert _plan(items, present, needed, PLACES) == [
        (0, 0, S3, None), (1, 0, S3, None), (2, 0, S3, None), (3, 0, S3, 0), (4, 0, S3, 1)]


@pytest.mark.unit
def test_the_bytes_crossing_zones_and_their_egress_dollars_by_hand():
    gb = 10**9
    items = [_chunk("a", "a.distcp", 2 * gb), _chunk("b", "b.distcp", 3 * gb),
             _chunk("c", "c.distcp", 5 * gb), _chunk("d", "d.distcp", 7 * gb)]
    present = {0: {"a.distcp"}, 1: {"b.distcp"}, 2: {"c.distcp"}, 3: {"a.distcp"}, 4: set()}
    # rank 3 (a1): a from its disk, b from rank 1 (b1: inter-region), c from rank 2 (a2:
    # inter-zone); rank 4 (b1): b from rank 1 (its zone), a from rank 0 or 3 (inter-region);
    # d only in S3: downloaded by rank 3 for a1 and by rank 4 for b1, nothing forwarded
    needed = {3: [0, 1, 2, 3], 4: [0, 1, 3]}
    fetches = assign_sources(items, [], needed, present, True, places=PLACES)
    assert [(f.rank, f.index, f.source, f.peer) for f in fetches] == [
        (3, 0, OWN, None), (3, 1, PEER, 1), (3, 2, PEER, 2), (3, 3, S3, None),
        (4, 0, PEER, 0), (4, 1, PEER, 1), (4, 3, S3, None)]
    traffic = zone_traffic(fetches, PLACES)
    # inside a zone: rank 1 -> 4, 3 GB; across: 1 -> 3 (3 GB at $0.02), 2 -> 3 (5 GB at $0.01),
    # 0 -> 4 (2 GB at $0.02)
    assert traffic.same_zone_bytes == 3 * gb
    assert traffic.other_zone_bytes == (3 + 5 + 2) * gb
    assert traffic.egress_usd == pytest.approx(3 * 0.02 + 5 * 0.01 + 2 * 0.02)   # $0.15

    report = RecoveryReport(7, job_bytes={OWN: 2 * gb, PEER: 13 * gb, S3: 14 * gb},
                            zones=traffic)
    assert ("local disks 1907.3 MiB, peers in the zone 2861.0 MiB, peers in other zones "
            "9536.7 MiB ($0.15 egress), S3 13351.4 MiB") in report.line()
    fields = report.event_fields()
    assert fields["other_zone_peer_bytes"] == 10 * gb and fields["egress_usd"] == \
        pytest.approx(0.15)
    # a fleet without zones: the line and the event as they always were
    plain = RecoveryReport(7, job_bytes={OWN: 0, PEER: 2**20, S3: 0})
    assert "peers 1.0 MiB, S3 0.0 MiB" in plain.line()
    assert set(plain.event_fields()) == {"bytes", "seconds"}
    assert ZoneTraffic() + traffic == traffic


def _resume_in_zones(rank, world, the_plan, batches, options, cluster):
    """A resume whose checkpointer knows the fleet's zones (as an elastic job's does)."""
    from megatron_autohet.checkpoint import checkpointer as module

    from helpers.checkpointing import train_job

    init, resume, reports = module.Checkpointer.__init__, module.Checkpointer.resume, []

    def zoned_init(self, *args, **kwargs):
        init(self, *args, cluster=cluster, **kwargs)

    def reported_resume(self):
        progress = resume(self)
        reports.append(self.last_report)
        return progress

    module.Checkpointer.__init__, module.Checkpointer.resume = zoned_init, reported_resume
    train_job(rank, world, the_plan, batches, options)
    return reports[0]


@pytest.mark.e2e
def test_a_recovery_across_zones_counts_the_bytes_crossing_them(tmp_path, s3_endpoint, s3_uri):
    """tiny-two-pipelines saved on local disks, the h800 node lost: the survivors' plan puts
    layers 0-2 on h20 (its own replicas) and 2-6 on the a100 node, which receives the lost
    layers 4-6 from h20's replicas. With a100 and h20 in two zones, every such byte crosses
    them: the report counts all the peers' bytes, across zones, at the link's price (S3 holds
    the step too, and serves nothing)."""
    from megatron_autohet.checkpoint.options import CheckpointOptions

    from helpers.checkpointing import HALF, TWO_PIPELINES as A, survivors_plan, train_job
    from helpers.dist_utils import run_on_ranks
    from helpers.training import global_batches, plan

    batches = global_batches(plan(A), HALF * 2)
    local = str(tmp_path / "local" / "{node}")
    endpoint, _ = s3_endpoint
    run_on_ranks(4, train_job, plan(A), batches,
                 CheckpointOptions(local_dir=local, save_interval=HALF, s3_uri=s3_uri,
                                   s3_endpoint_url=endpoint), exit_interval=HALF)
    shutil.rmtree(local.replace("{node}", "h800"))
    survivors = survivors_plan(["h20", "a100"], [0, 2, 6])
    cluster = cluster_from_dict({
        "name": "local-4", "inter_node_bandwidth_gbs": 25, "zones": {"x": "r", "y": "r"},
        "links": {"inter_zone": {"egress_usd_per_gb": 0.5}},
        "nodes": [{"name": "a100", "gpu": "A100-80GB", "gpus": 2, "zone": "x"},
                  {"name": "h20", "gpu": "H20", "gpus": 1, "zone": "y"}]})
    reports = run_on_ranks(survivors.world_size, _resume_in_zones, survivors, batches,
                           CheckpointOptions(load=local, s3_uri=s3_uri, s3_endpoint_url=endpoint),
                           cluster, timeout=600)
    report = reports[0]
    peers = report.job_bytes[PEER]
    assert peers > 0 and report.job_bytes[S3] == 0
    assert report.zones == ZoneTraffic(0, peers, pytest.approx(peers / 1e9 * 0.5))
    assert all(r.zones == report.zones for r in reports)       # the job's, on every rank
    assert f"peers in other zones {peers / 2**20:.1f} MiB" in report.line()
