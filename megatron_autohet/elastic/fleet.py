"""The fleet a (re)started elastic job finds, as a cluster the planner can plan for (no torch).

torchrun numbers its workers anew on every restart and knows nothing of GPU types, so each worker
says who it is: a :class:`Member` (its node's name, the node's GPU type, its GPU index on the
node). :func:`fleet_cluster` turns the members into a :class:`Cluster`, taking link bandwidths
and prices from the job's cluster file: the entry of the same node name if there is one (a
known machine), else the first entry with the same GPU type (a new spot node of a known kind).
On a cluster file across zones the fleet keeps them: each node the zone of the entry it is
priced from, the file's zones and links, so a re-plan prices the links between the zones left.
:func:`plan_ranks` maps each worker to the plan rank on its (node, GPU), or None for a GPU the
plan leaves idle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Plan
from megatron_autohet.spec.cluster import Cluster, Node


@dataclass(frozen=True)
class Member:
    node: str         # the node's name: stable across restarts (hostname or AUTOHET_NODE)
    gpu: str          # GPU type, a key of the catalog
    local_rank: int   # GPU index on the node

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Member":
        return cls(str(data["node"]), str(data["gpu"]), int(data["local_rank"]))


def fleet_cluster(members: list[Member], template: Cluster, *, name: str | None = None) -> Cluster:
    """The nodes present, in order of first appearance of each node (torchrun's rank order)."""
    gpus: dict[str, str] = {}
    counts: dict[str, int] = {}
    for m in members:
        if gpus.setdefault(m.node, m.gpu) != m.gpu:
            raise ConfigError("<fleet>", f"node {m.node}", f"GPUs of two types ({gpus[m.node]}, "
                              f"{m.gpu})", "one GPU type per node")
        counts[m.node] = counts.get(m.node, 0) + 1
    nodes = []
    for node, gpu in gpus.items():
        like = _template_node(template, node, gpu)
        nodes.append(Node(node, gpu, counts[node], like.intra_node_bandwidth_gbs,
                          like.inter_node_bandwidth_gbs, like.spot_price, like.zone))
    types = {}
    for node in nodes:
        types[node.gpu] = template.gpu_types[node.gpu]
    return Cluster(name or template.name, tuple(nodes), types, regions=template.regions,
                   links=template.links)


def _template_node(template: Cluster, node: str, gpu: str) -> Node:
    like = template.node_like(node, gpu)
    if like is None:
        raise ConfigError(template.name, "nodes", f"no node with GPU type {gpu} (node {node} "
                          "joined with one)", "an entry for every GPU type the job may run on")
    if like.name == node and like.gpu != gpu:
        raise ConfigError(template.name, f"nodes.{node}.gpu", f"{like.gpu}, but the node "
                          f"reports {gpu}", "the GPU type the node has")
    return like


def plan_ranks(plan: Plan, members: list[Member]) -> list[int | None]:
    """For each worker (torchrun rank), the plan rank on its (node, GPU), or None (idle)."""
    by_place = {(info.node, info.local_rank): info.rank for info in plan.ranks}
    out = [by_place.get((m.node, m.local_rank)) for m in members]
    missing = set(by_place.values()) - set(r for r in out if r is not None)
    if missing:
        raise ConfigError("<plan>", "ranks", f"plan ranks {sorted(missing)} are on GPUs no "
                          "worker has", "a plan for the fleet present")
    return out


def gpu_type_of_device(device_name: str, catalog_names: list[str]) -> str | None:
    """The catalog type a CUDA device name denotes ("NVIDIA A100-SXM4-80GB" -> "A100-80GB"): the
    key whose every ``-``/space separated token is in the name, the most specific one winning."""
    tokens = set(device_name.upper().replace("-", " ").split())
    best, best_len = None, 0
    for name in catalog_names:
        wanted = set(name.upper().replace("-", " ").split())
        if wanted <= tokens and len(wanted) > best_len:
            best, best_len = name, len(wanted)
    return best
