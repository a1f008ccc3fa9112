"""A cluster: nodes, each with one GPU type and a GPU count, joined by a network; its zones.

YAML form (``configs/clusters/*.yaml``)::

    name: a100-h800-h20
    inter_node_bandwidth_gbs: 25        # default NIC bandwidth per node, GB/s per direction
    nodes:
      - name: a100                      # with count > 1, nodes are named a100-0, a100-1, ...
        gpu: A100-80GB                  # a key of the GPU catalog
        gpus: 8                         # GPUs per node
        count: 2                        # identical nodes (default 1)
        intra_node_bandwidth_gbs: 300   # optional, default: the catalog's figure for the GPU
        inter_node_bandwidth_gbs: 50    # optional NIC override for these nodes
        spot_price: 1.10                # optional, USD per GPU-hour
    slow_gpus:                          # optional: GPUs running slower than their type
      - {node: a100-1, local_rank: 3, speed: 0.6}   # this GPU computes at 0.6x its type

A fleet spread over zones and regions (``configs/clusters/two-zones.yaml``) names each node's
``zone`` and maps every zone to its region once, in a ``zones`` section; ``links`` says what the
network between zones is::

    zones:                              # zone -> its region
      us-east-1a: us-east-1
      us-east-1b: us-east-1
      us-west-2a: us-west-2
    links:                              # optional, each field too: the defaults below
      inter_zone:   {bandwidth_gbs: 1.25, latency_ms: 2, egress_usd_per_gb: 0.01}
      inter_region: {bandwidth_gbs: 0.625, latency_ms: 30, egress_usd_per_gb: 0.02}
    nodes:
      - {name: a100, gpu: A100-80GB, gpus: 8, zone: us-east-1a}

Why a ``zones`` section and not a ``region`` on every node: a zone belongs to one region, so it
is said once and no two nodes can disagree about it; and the region cannot be read off the
zone's name in general (an Azure zone is ``1``, ``2`` or ``3`` in every region). With a
``zones`` section every node names one of its zones; without one no node may, and the cluster
is one zone (a file without zones means what it always meant). ``inter_zone`` is the link
between two zones of one region, ``inter_region`` between zones of two regions: its
``bandwidth_gbs`` (GB/s per direction, like the NICs) is what the transfers crossing one zone
pair share at once, ``latency_ms`` what each message waits before its bytes move (one way), and
``egress_usd_per_gb`` what each GB crossing it is billed (``Cluster.link``; the cost model
prices them, cost_model.py "Zones"). The defaults (DEFAULT_LINKS) come from public figures:
bandwidth from EC2's documented 5 Gbit/s per flow outside a cluster placement group (0.625 GB/s;
between regions EC2 also caps an instance below 32 vCPUs at 5 Gbit/s in all), twice that
between zones of one region (10 Gbit/s, 1.25 GB/s: a few flows), where an instance may use its
full bandwidth but a job's flows between two zones share what the zone pair gives them; latency
2 ms between zones of a region (the providers promise single-digit milliseconds) and 30 ms
between regions (about half the round trip between the US east and west coasts); egress at
Google Cloud's VM-to-VM list prices, $0.01/GB between zones of a region and $0.02/GB between
regions in North America (AWS bills $0.01/GB each way between zones, so $0.02 per GB crossing:
say so in ``links`` for an AWS fleet).

Global ranks are numbered node by node in file order, GPUs in local order inside a node; the
plan and the launcher rely on that numbering.

A GPU is identified by its node and its local rank. ``Cluster.speeds`` says which of them run
slower than their type (a straggler: thermal throttling, a noisy neighbour, a failing part):
``speed`` 0.6 means its forward and backward take 1 / 0.6 of its type's time. The cost model
prices a stage on such a GPU that much slower (a TP group computes in lock step, at its
slowest member's speed), and the planner's TP-group pools keep slowed groups apart
(planner/space.py), so a plan may move layers or micro-batches off them or leave them idle. A
job measures the speeds itself (profiling/from_run.py ``find_stragglers``); a cluster file
may state them (``slow_gpus``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path

from megatron_autohet.errors import ConfigError
from megatron_autohet.spec._yaml import check_keys, get_field, read_yaml_mapping
from megatron_autohet.spec.gpus import GPUType, load_gpu_catalog


@dataclass(frozen=True)
class Node:
    name: str
    gpu: str                          # GPU type name (catalog key)
    num_gpus: int
    intra_node_bandwidth_gbs: float   # GB/s per direction between two GPUs of this node
    inter_node_bandwidth_gbs: float   # NIC, GB/s per direction
    spot_price: float | None = None   # USD per GPU-hour
    zone: str | None = None           # None: a cluster without zones (module doc)


@dataclass(frozen=True)
class ZoneLink:
    """The network between two zones (module doc, ``links``)."""

    bandwidth_gbs: float        # GB/s per direction, shared by the transfers crossing it at once
    latency_ms: float           # what each message waits before its bytes move, one way
    egress_usd_per_gb: float    # USD per GB crossing it


@dataclass(frozen=True)
class Links:
    inter_zone: ZoneLink        # between two zones of one region
    inter_region: ZoneLink      # between zones of two regions


# The links of a file with zones but without them (module doc: the public figures they are from).
DEFAULT_LINKS = Links(inter_zone=ZoneLink(1.25, 2.0, 0.01),
                      inter_region=ZoneLink(0.625, 30.0, 0.02))


@dataclass(frozen=True)
class Link:
    """What a transfer between GPUs of two nodes crosses (:meth:`Cluster.link`)."""

    bandwidth_gbs: float        # GB/s per direction: the slower NIC, and the zone link if any
    latency_s: float            # per message: the zone link's, 0 inside a zone
    egress_usd_per_gb: float    # 0 inside a zone
    zones: tuple[str, str] | None = None   # the zone pair crossed (sorted); None inside a zone


@dataclass(frozen=True)
class Device:
    rank: int        # global rank
    node: str
    local_rank: int  # GPU index inside the node
    gpu: str


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: tuple[Node, ...]
    gpu_types: dict[str, GPUType]     # the catalog entries of the GPU types used here
    # (node, local rank) -> speed in (0, 1): GPUs slower than their type (module doc); a GPU
    # not listed runs at its type's speed (1.0)
    speeds: dict[tuple[str, int], float] = field(default_factory=dict)
    # zone -> region (module doc); empty: a cluster without zones, every node in one
    regions: dict[str, str] = field(default_factory=dict)
    links: Links = DEFAULT_LINKS

    def speed(self, node: str, local_rank: int) -> float:
        """How fast this GPU computes relative to its type (1.0: as its type)."""
        return self.speeds.get((node, local_rank), 1.0)

    def with_speeds(self, speeds: dict[tuple[str, int], float]) -> "Cluster":
        """The same nodes with these GPU speeds (replacing any it had; 1.0 entries dropped,
        GPUs the cluster lacks ignored): a straggler priced slower, a recovered one at 1.0."""
        have = {(d.node, d.local_rank) for d in self._devices}
        return replace(self, speeds={k: float(v) for k, v in sorted(speeds.items())
                                     if k in have and v != 1.0})

    @property
    def world_size(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    def devices(self) -> list[Device]:
        return list(self._devices)

    @functools.cached_property
    def _devices(self) -> tuple[Device, ...]:
        # Plans and their evaluation list the devices many times per search: built once.
        out, rank = [], 0
        for node in self.nodes:
            for local in range(node.num_gpus):
                out.append(Device(rank, node.name, local, node.gpu))
                rank += 1
        return tuple(out)

    def node(self, name: str) -> Node:
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict[str, Node]:
        # The cost model looks nodes up per stage and per sync group: a scan would make
        # evaluating a plan quadratic in the fleet size.
        return {n.name: n for n in self.nodes}

    def link(self, node_a: str, node_b: str) -> Link:
        """The link between two GPUs on these nodes: the intra-node link on one node; across
        nodes the slower NIC, and between zones the zone link too (its bandwidth if smaller,
        its latency and egress price)."""
        a, b = self.node(node_a), self.node(node_b)
        if a.name == b.name:
            return Link(a.intra_node_bandwidth_gbs, 0.0, 0.0)
        nic = min(a.inter_node_bandwidth_gbs, b.inter_node_bandwidth_gbs)
        between = self.zone_link(a.zone, b.zone)
        if between is None:
            return Link(nic, 0.0, 0.0)
        return Link(min(nic, between.bandwidth_gbs), between.latency_ms / 1e3,
                    between.egress_usd_per_gb, tuple(sorted((a.zone, b.zone))))

    def zone_link(self, zone_a: str | None, zone_b: str | None) -> ZoneLink | None:
        """The link between two zones; None inside one zone, or where a zone is not known
        (None: a cluster without zones, or the planner's pool of nodes across zones)."""
        if zone_a == zone_b or zone_a is None or zone_b is None:
            return None
        if self.regions[zone_a] == self.regions[zone_b]:
            return self.links.inter_zone
        return self.links.inter_region

    def zone_nodes(self, zone: str) -> list[str]:
        """The names of the nodes in ``zone``, in the cluster's order."""
        return [n.name for n in self.nodes if n.zone == zone]

    def node_like(self, name: str, gpu: str) -> Node | None:
        """The entry a node ``name`` with GPUs of type ``gpu`` is priced from (links, price,
        zone): its own entry, else the first of its GPU type, else None."""
        own = next((n for n in self.nodes if n.name == name), None)
        return own or next((n for n in self.nodes if n.gpu == gpu), None)

    def without_zones(self) -> "Cluster":
        """The same nodes as one zone: every link priced as the NICs, no egress (what a planner
        that cannot see zones plans on)."""
        return replace(self, nodes=tuple(replace(n, zone=None) for n in self.nodes),
                       regions={}, links=DEFAULT_LINKS)

    def counts_by_type(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.gpu] = counts.get(n.gpu, 0) + n.num_gpus
        return counts

    def subset(self, node_names: list[str], name: str | None = None) -> "Cluster":
        """The cluster restricted to some nodes (e.g. the survivors of a preemption)."""
        keep = set(node_names)
        nodes = tuple(n for n in self.nodes if n.name in keep)
        types = {n.gpu: self.gpu_types[n.gpu] for n in nodes}
        return Cluster(name or self.name, nodes, types,
                       {k: v for k, v in self.speeds.items() if k[0] in keep},
                       self.regions, self.links)


_CLUSTER_FIELDS = {"name", "inter_node_bandwidth_gbs", "nodes", "description", "slow_gpus",
                   "zones", "links"}
_NODE_FIELDS = {"name", "gpu", "gpus", "count", "intra_node_bandwidth_gbs",
                "inter_node_bandwidth_gbs", "spot_price", "zone"}
_ZONE_LINK_FIELDS = {"bandwidth_gbs", "latency_ms", "egress_usd_per_gb"}


def load_cluster(path: str | Path, catalog: dict[str, GPUType] | None = None) -> Cluster:
    path = Path(path)
    data = read_yaml_mapping(path)
    return cluster_from_dict(data, path, catalog)


def cluster_from_dict(data: dict, file="<cluster>", catalog: dict[str, GPUType] | None = None
                      ) -> Cluster:
    catalog = catalog if catalog is not None else load_gpu_catalog()
    check_keys(data, _CLUSTER_FIELDS, file, "")
    name = get_field(data, "name", str, file)
    default_nic = get_field(data, "inter_node_bandwidth_gbs", float, file, positive=True)
    regions = _zones(data, file)
    entries = get_field(data, "nodes", list, file)
    if not entries:
        raise ConfigError(file, "nodes", "empty", "a list of at least one node")
    nodes: list[Node] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"nodes[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(file, where, f"expected a mapping, got {entry!r}")
        check_keys(entry, _NODE_FIELDS, file, where)
        base = get_field(entry, "name", str, file, where)
        gpu = get_field(entry, "gpu", str, file, where)
        if gpu not in catalog:
            raise ConfigError(file, f"{where}.gpu", f"unknown GPU type {gpu!r}",
                              ", ".join(sorted(catalog)))
        num_gpus = get_field(entry, "gpus", int, file, where, positive=True)
        count = get_field(entry, "count", int, file, where, default=1, positive=True)
        intra = get_field(entry, "intra_node_bandwidth_gbs", float, file, where,
                          default=catalog[gpu].intra_node_bandwidth_gbs, positive=True)
        nic = get_field(entry, "inter_node_bandwidth_gbs", float, file, where,
                        default=default_nic, positive=True)
        price = get_field(entry, "spot_price", float, file, where, default=None, min_value=0)
        zone = _node_zone(entry, file, where, regions)
        names = [base] if count == 1 else [f"{base}-{k}" for k in range(count)]
        for node_name in names:
            if node_name in seen:
                raise ConfigError(file, f"{where}.name", f"duplicate node name {node_name!r}",
                                  "unique node names")
            seen.add(node_name)
            nodes.append(Node(node_name, gpu, num_gpus, intra, nic, price, zone))
    types = {n.gpu: catalog[n.gpu] for n in nodes}
    return Cluster(name, tuple(nodes), types, _slow_gpus(data, file, nodes), regions,
                   _links(data, file, regions))


def _zones(data: dict, file) -> dict[str, str]:
    """The ``zones`` section: zone -> region, both non-empty strings (empty: no zones)."""
    zones = get_field(data, "zones", dict, file, default={})
    if "zones" in data and not zones:
        raise ConfigError(file, "zones", "empty", "a mapping of each zone to its region, "
                          "e.g. {us-east-1a: us-east-1}, or no zones section")
    for zone, region in zones.items():
        if not isinstance(zone, str) or not zone or not isinstance(region, str) or not region:
            raise ConfigError(file, f"zones.{zone}", f"got {zone!r}: {region!r}",
                              "a zone name mapped to its region's name, e.g. "
                              "us-east-1a: us-east-1")
    return dict(zones)


def _node_zone(entry: dict, file, where: str, regions: dict[str, str]) -> str | None:
    """A node's ``zone``: one of the ``zones`` section's, on every node when there is one."""
    if not regions:
        if "zone" in entry:
            raise ConfigError(file, f"{where}.zone", f"got {entry['zone']!r} without a zones "
                              "section", "a zone of a top-level zones section (zone: region)")
        return None
    if "zone" not in entry:
        raise ConfigError(file, f"{where}.zone", "missing (the file has a zones section)",
                          ", ".join(regions))
    zone = get_field(entry, "zone", str, file, where)
    if zone not in regions:
        raise ConfigError(file, f"{where}.zone", f"unknown zone {zone!r}", ", ".join(regions))
    return zone


def _links(data: dict, file, regions: dict[str, str]) -> Links:
    """The ``links`` section: each zone link's fields, DEFAULT_LINKS' where left out."""
    links = get_field(data, "links", dict, file, default={})
    if links and not regions:
        raise ConfigError(file, "links", "given without a zones section (a cluster without "
                          "zones has no links between zones)", "a links section beside zones")
    check_keys(links, {"inter_zone", "inter_region"}, file, "links")
    out = {}
    for kind in ("inter_zone", "inter_region"):
        where = f"links.{kind}"
        entry = get_field(links, kind, dict, file, "links", default={})
        check_keys(entry, _ZONE_LINK_FIELDS, file, where)
        default = getattr(DEFAULT_LINKS, kind)
        out[kind] = ZoneLink(
            get_field(entry, "bandwidth_gbs", float, file, where,
                      default=default.bandwidth_gbs, positive=True),
            get_field(entry, "latency_ms", float, file, where, default=default.latency_ms,
                      min_value=0),
            get_field(entry, "egress_usd_per_gb", float, file, where,
                      default=default.egress_usd_per_gb, min_value=0))
    return Links(**out)


def _slow_gpus(data: dict, file, nodes: list[Node]) -> dict[tuple[str, int], float]:
    """The ``slow_gpus`` field: each entry a GPU of the cluster (node, local_rank) and its
    speed in (0, 1]."""
    by_name = {n.name: n for n in nodes}
    speeds: dict[tuple[str, int], float] = {}
    for i, entry in enumerate(get_field(data, "slow_gpus", list, file, default=[])):
        where = f"slow_gpus[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(file, where, f"expected a mapping, got {entry!r}")
        check_keys(entry, {"node", "local_rank", "speed"}, file, where)
        node = get_field(entry, "node", str, file, where)
        if node not in by_name:
            raise ConfigError(file, f"{where}.node", f"unknown node {node!r}",
                              ", ".join(by_name))
        local = get_field(entry, "local_rank", int, file, where, min_value=0)
        if local >= by_name[node].num_gpus:
            raise ConfigError(file, f"{where}.local_rank", f"got {local}; {node} has "
                              f"{by_name[node].num_gpus} GPUs",
                              f"0..{by_name[node].num_gpus - 1}")
        speed = get_field(entry, "speed", float, file, where)
        if not 0 < speed <= 1:
            raise ConfigError(file, f"{where}.speed", f"got {speed!r}",
                              "a fraction of the GPU type's speed in (0, 1]")
        if speed != 1.0:
            speeds[node, local] = speed
    return speeds


def trains_in(gpu: GPUType, precision: str) -> bool:
    """Whether a job may train on ``gpu`` in ``precision`` (a spec/precision.py name): bf16 only
    where the GPU has it (the catalog's ``bf16: false``: V100, T4). The one test every planning
    path (:func:`trainable_fleet`) and ``autohet train`` (plan.py ``check_bf16_support``) apply;
    fp16 never gets here (profiles and flags refuse it: the runtime has no loss scaler)."""
    return precision != "bf16" or gpu.bf16


def trainable_fleet(cluster: Cluster, precision: str, file: str | Path = "<cluster>"
                    ) -> tuple[Cluster, dict[str, int]]:
    """The cluster without its nodes whose GPU type cannot train in ``precision`` (a
    spec/precision.py name; :func:`trains_in`: bf16 needs the catalog's ``bf16: true``, which
    V100 and T4 lack), under the same name, and the GPUs left out by type: what a plan in that
    precision may use. The runtime trains 16-bit only in bf16 (fp16 needs a dynamic loss scaler
    it does not have), so every planning path (``autohet plan``, ``compare``, ``replan``, the
    elastic re-plan) plans on this fleet; a cluster with none left is a ConfigError."""
    kept, left_out = [], {}
    for node in cluster.nodes:
        if trains_in(cluster.gpu_types[node.gpu], precision):
            kept.append(node.name)
        else:
            left_out[node.gpu] = left_out.get(node.gpu, 0) + node.num_gpus
    if not left_out:
        return cluster, {}
    if not kept:
        raise ConfigError(file, "nodes", f"no GPU with {precision} ({', '.join(sorted(left_out))} "
                          f"have {precision}: false in the GPU catalog), and this runtime trains "
                          f"16-bit only in bf16 (fp16 needs a dynamic loss scaler it does not "
                          f"have)", "nodes with bf16 GPUs (A100, H100, L4, ...), or a profile "
                          "measured in fp32 (autohet profile on a CPU) for fp32 plans")
    return cluster.subset(kept), left_out
