"""Cluster files with zones: the zones section, each node's zone, the links between zones with
their defaults, and one clear error for each bad value (real files in tmp_path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_autohet.errors import ConfigError
from megatron_autohet.spec.cluster import (DEFAULT_LINKS, Link, Links, ZoneLink, load_cluster)

pytestmark = pytest.mark.unit

CLUSTERS = Path(__file__).resolve().parents[2] / "configs" / "clusters"
ZONES = {"us-east-1a": "us-east-1", "us-east-1b": "us-east-1", "us-west-2a": "us-west-2"}


def cluster_file(tmp_path: Path, nodes=None, **top) -> Path:
    nodes = nodes if nodes is not None else [
        {"name": "a", "gpu": "A100-80GB", "gpus": 8, "zone": "us-east-1a"},
        {"name": "b", "gpu": "A100-80GB", "gpus": 8, "zone": "us-east-1a",
         "inter_node_bandwidth_gbs": 0.5},
        {"name": "c", "gpu": "H800", "gpus": 8, "zone": "us-east-1b"},
        {"name": "d", "gpu": "H800", "gpus": 8, "zone": "us-west-2a"}]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"name": "z", "inter_node_bandwidth_gbs": 25,
                                    "zones": ZONES, "nodes": nodes, **top}))
    return path


def expect_error(path: Path, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert str(info.value) == f"{path}: {message}"


def test_links_between_nodes_of_zones_and_regions(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path, links={
        "inter_zone": {"bandwidth_gbs": 3, "latency_ms": 1.5, "egress_usd_per_gb": 0.02},
        "inter_region": {"bandwidth_gbs": 1, "latency_ms": 40, "egress_usd_per_gb": 0.05}}))
    assert [n.zone for n in cluster.nodes] == ["us-east-1a", "us-east-1a", "us-east-1b",
                                               "us-west-2a"]
    assert cluster.regions == ZONES
    # inside a zone: the slower NIC, no latency, nothing billed; inside a node: its link
    assert cluster.link("a", "b") == Link(0.5, 0.0, 0.0)
    assert cluster.link("a", "a") == Link(300.0, 0.0, 0.0)
    # between zones of a region: the zone link's bandwidth (below both NICs), its latency,
    # its price, the zone pair sorted
    assert cluster.link("c", "a") == Link(3.0, 0.0015, 0.02, ("us-east-1a", "us-east-1b"))
    # ... unless a NIC is slower
    assert cluster.link("b", "c").bandwidth_gbs == 0.5
    assert cluster.link("a", "d") == Link(1.0, 0.04, 0.05, ("us-east-1a", "us-west-2a"))
    # a subset keeps the zones and links
    assert cluster.subset(["a", "d"]).link("a", "d") == cluster.link("a", "d")


def test_links_left_out_get_the_defaults(tmp_path):
    assert load_cluster(cluster_file(tmp_path)).links == DEFAULT_LINKS
    assert DEFAULT_LINKS == Links(ZoneLink(1.25, 2.0, 0.01), ZoneLink(0.625, 30.0, 0.02))
    # each field alone too
    cluster = load_cluster(cluster_file(tmp_path, links={"inter_zone": {"latency_ms": 5}}))
    assert cluster.links == Links(ZoneLink(1.25, 5.0, 0.01), DEFAULT_LINKS.inter_region)


def test_a_file_without_zones_is_one_zone(tmp_path):
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": "a", "gpu": "A100-80GB", "gpus": 8},
        {"name": "b", "gpu": "H800", "gpus": 8, "inter_node_bandwidth_gbs": 12}]}))
    cluster = load_cluster(path)
    assert cluster.regions == {} and [n.zone for n in cluster.nodes] == [None, None]
    assert cluster.link("a", "b") == Link(12.0, 0.0, 0.0)


def test_bundled_two_zones():
    cluster = load_cluster(CLUSTERS / "two-zones.yaml")
    assert {n.zone for n in cluster.nodes} == {"us-east-1a", "us-east-1b"}
    assert cluster.link("a100-0", "h800-1") == Link(1.25, 0.002, 0.02,
                                                    ("us-east-1a", "us-east-1b"))


ALL_ZONES = "us-east-1a, us-east-1b, us-west-2a"


@pytest.mark.parametrize("change, message", [
    (lambda d: d["nodes"][2].update(zone="eu-west-1a"),
     f"field 'nodes[2].zone': unknown zone 'eu-west-1a' (allowed: {ALL_ZONES})"),
    (lambda d: d["nodes"][1].pop("zone"),
     f"field 'nodes[1].zone': missing (the file has a zones section) (allowed: {ALL_ZONES})"),
    (lambda d: d["nodes"][0].update(zone=3),
     "field 'nodes[0].zone': got 3 (int) (allowed: a string)"),
    (lambda d: d.pop("zones"),
     "field 'nodes[0].zone': got 'us-east-1a' without a zones section (allowed: a zone of a "
     "top-level zones section (zone: region))"),
    (lambda d: d.update(zones={}),
     "field 'zones': empty (allowed: a mapping of each zone to its region, e.g. "
     "{us-east-1a: us-east-1}, or no zones section)"),
    (lambda d: d.update(zones={"us-east-1a": None}),
     "field 'zones.us-east-1a': got 'us-east-1a': None (allowed: a zone name mapped to its "
     "region's name, e.g. us-east-1a: us-east-1)"),
    (lambda d: d.update(zones=["us-east-1a"]),
     "field 'zones': got ['us-east-1a'] (list) (allowed: a mapping)"),
    (lambda d: d.update(links={"inter_zone": {"bandwidth_gbs": 0}}),
     "field 'links.inter_zone.bandwidth_gbs': got 0.0 (allowed: a number > 0)"),
    (lambda d: d.update(links={"inter_region": {"latency_ms": -1}}),
     "field 'links.inter_region.latency_ms': got -1.0 (allowed: a number >= 0)"),
    (lambda d: d.update(links={"inter_region": {"egress_usd_per_gb": -0.01}}),
     "field 'links.inter_region.egress_usd_per_gb': got -0.01 (allowed: a number >= 0)"),
    (lambda d: d.update(links={"inter_zone": {"bandwidth": 1}}),
     "field 'links.inter_zone.bandwidth': unknown field (allowed: bandwidth_gbs, "
     "egress_usd_per_gb, latency_ms)"),
    (lambda d: d.update(links={"intra_zone": {}}),
     "field 'links.intra_zone': unknown field (allowed: inter_region, inter_zone)"),
    (lambda d: d.update(links={"inter_zone": 5}),
     "field 'links.inter_zone': got 5 (int) (allowed: a mapping)"),
])
def test_bad_zones_and_links(tmp_path, change, message):
    data = yaml.safe_load(cluster_file(tmp_path).read_text())
    change(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    expect_error(path, message)


def test_links_without_zones(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "inter_node_bandwidth_gbs": 25,
                                    "links": {"inter_zone": {"latency_ms": 1}},
                                    "nodes": [{"name": "a", "gpu": "A100-80GB", "gpus": 8}]}))
    expect_error(path, "field 'links': given without a zones section (a cluster without zones "
                 "has no links between zones) (allowed: a links section beside zones)")
