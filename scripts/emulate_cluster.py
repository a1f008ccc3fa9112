#!/usr/bin/env python
"""Emulate a heterogeneous GPU cluster on one machine: processes of different speed joined by
links of different bandwidth.

A cluster YAML (spec/cluster.py's format) whose GPU types come from an emulation catalog
(``configs/emulated/gpus.yaml``) maps onto this machine as follows (needs root and iproute2;
never part of the test suite, the pure logic below is unit-tested):

* **GPU -> process at a CPU share.** Each GPU type runs at a fixed share of one CPU core
  (``configs/emulated/cpu_shares.yaml``). Every emulated GPU is one process in a cgroup (v1
  ``cpu`` controller, ``/sys/fs/cgroup/cpu``) of its own with the CFS quota of its share: 2 ms
  of CPU per ``2 ms / share`` period. A short period keeps the throttling granularity (a
  process runs its quota, then waits out the period) at a few ms, so a millisecond-scale op is
  slowed evenly instead of either running free or waiting out a 100 ms default period; too
  short a period loses CPU to throttling and unthrottling (a busy loop asking 0.6 / 0.3 / 0.15
  got 0.45 / 0.29 / 0.18 with a 1 ms quota, 0.52 / 0.31 / 0.18 with 2 ms, 0.61 / 0.32 / 0.17
  with 4 ms, on a loaded machine). What a type gets is measured anyway: it is profiled inside
  its quota (scripts/bench_emulated.py). A quota slows evenly only work much longer than its
  period: a process that waited starts with a whole quota and overruns it until the next
  scheduler tick (4 ms, HZ=250), so a short burst after a wait runs faster than the share (a
  busy loop at 0.3 of a core, bursts after a 20 ms sleep: 4 ms of CPU at 0.60, 8 ms at 0.40,
  40 ms at 0.32; continuous 0.300); the kernel's minimum quota is 1 ms, so emulated work must
  come in bursts of tens of ms. One torch thread per process (``OMP_NUM_THREADS=1``). The shares of
  all GPUs must sum to less than the machine's cores, or the quota is not what a process gets.
  A quota is a ceiling, not a guarantee: other work on the machine competes for the cores. The
  run's parent cgroup therefore gets the largest CFS weight (``cpu.shares``), so while the
  emulated GPUs want CPU they get their quota first and the rest of the machine what is left
  (at least the cores minus the shares' sum); without that, a loaded machine slows every
  emulated GPU towards the same speed. Each emulated GPU is also pinned to one CPU
  (``taskset``), the shares packed so that no CPU carries more than one core's worth.
* **Node -> network namespace.** Every node is a namespace with one veth into a Linux bridge
  (in a "fabric" namespace, the switch); the node's NIC bandwidth
  (``inter_node_bandwidth_gbs``, GB/s; x 8000 = Mbit/s) is a token-bucket filter on both ends of
  its veth, so a node sends and receives at most that rate, and a pair of nodes talks at the
  slower NIC's rate, as the cost model assumes. GPUs of one node talk over the namespace's
  loopback, unshaped (the emulated NVLink/PCIe).
* **Zones -> a bridge each, one shaped link between them.** On a cluster across two zones
  (``zones:``, ``links:``) each zone's nodes are on a bridge of their own, and the two bridges
  are joined by one veth pair whose ends each delay what they send by the zone link's latency
  and send at most its bandwidth (``tc netem delay ... rate ...``): a transfer between zones runs
  at the smaller of the NICs and the zone link, waits the link's latency one way, and every
  transfer crossing at once shares the link, as the cost model prices it. More than two zones
  (a link per zone pair) would make a loop of bridges; they are refused. A kernel built without
  netem (``CONFIG_NET_SCH_NETEM``) cannot delay: the link is then rate-limited with tbf alone
  and a WARNING says that its latency is not emulated.
* **Rank -> (namespace, cgroup).** Global rank r is the cluster's device r (spec/cluster.py: node
  by node in file order), or with a plan the plan's rank r, placed on the node and local GPU the
  plan names. Each process gets the torchrun environment (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR`` = rank 0's node address, ``MASTER_PORT``) and
  ``GLOO_SOCKET_IFNAME`` = its node's veth, so ``autohet train`` runs unchanged. A tiny ``sh``
  wrapper writes its pid into the cgroup's ``tasks`` file, then execs ``ip netns exec NS``
  and so the command, so the command and every child it starts are confined from the first
  instruction.

* **A straggler.** A rank's quota can change while it runs (:func:`set_share`; from the
  command line ``--set-share RANK=SHARE --prefix P``, which rewrites that rank's cgroup of the
  running emulation and exits): the kernel applies the new period at once, so a GPU slows down
  or recovers in the middle of a job (scripts/bench_adapt.py's straggler scenario).

Everything created (namespaces, cgroups, processes) is recorded as it is created and removed in
reverse order on exit, on Ctrl-C and on SIGTERM; leftovers of an earlier run killed with SIGKILL
(same ``--prefix``) are removed before building. Example, three iterations of a plan::

    sudo python scripts/emulate_cluster.py --cluster configs/emulated/three-speeds.yaml \\
        --plan plan.yaml -- python -m megatron_autohet.cli.main train --plan plan.yaml \\
        --model configs/emulated/emu-gpt.yaml --iters 3
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _netns

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_autohet.errors import ConfigError  # noqa: E402
from megatron_autohet.spec._yaml import check_keys, get_field, read_yaml_mapping  # noqa: E402
from megatron_autohet.spec.cluster import Cluster, load_cluster  # noqa: E402
from megatron_autohet.spec.gpus import load_gpu_catalog  # noqa: E402

EMULATED_DIR = ROOT / "configs" / "emulated"
DEFAULT_CATALOG = EMULATED_DIR / "gpus.yaml"
DEFAULT_SHARES = EMULATED_DIR / "cpu_shares.yaml"
CGROUP_CPU_ROOT = Path("/sys/fs/cgroup/cpu")
DEFAULT_PREFIX = "ahemu"
SUBNET = "10.214.0"          # node i is SUBNET.(i + 1)/24 on the bridge
QUOTA_US = 2000              # CPU time per period of every emulated GPU (module doc)
MAX_PERIOD_US = 1_000_000    # the kernel refuses a larger cfs_period_us
DEFAULT_QUEUE_MS = 20.0
# cpu.shares of the run's parent cgroup: the largest weight, so the emulated GPUs get their quota
# before the machine's other work does (module doc).
PRIORITY_SHARES = 262144


# ---- the emulated fleet (pure) -------------------------------------------------------------------

@dataclass(frozen=True)
class EmulatedFleet:
    cluster: Cluster
    cpu_share: dict[str, float]       # GPU type -> fraction of one core

    @property
    def total_share(self) -> float:
        return round(sum(self.cpu_share[d.gpu] for d in self.cluster.devices()), 9)

    def link_mbit(self, node: str) -> float:
        """The rate of the node's shaped veth: its NIC bandwidth (GB/s per direction) in Mbit/s."""
        return self.cluster.node(node).inter_node_bandwidth_gbs * 8000.0

    @property
    def zones(self) -> list[str]:
        """The zones the nodes are in, in order of first appearance; empty without zones."""
        if not self.cluster.regions:
            return []
        return list(dict.fromkeys(n.zone for n in self.cluster.nodes))


def load_cpu_shares(path: str | Path = DEFAULT_SHARES) -> dict[str, float]:
    """``cpu_share: {TYPE: fraction of one core}``, each in (0, 1]."""
    data = read_yaml_mapping(path)
    check_keys(data, {"cpu_share"}, path, "")
    shares = get_field(data, "cpu_share", dict, path)
    out = {}
    for name in shares:
        value = get_field(shares, name, float, path, "cpu_share", positive=True)
        if value > 1.0 or value < QUOTA_US / MAX_PERIOD_US:
            raise ConfigError(path, f"cpu_share.{name}", f"got {value!r}",
                              f"a fraction of one core in [{QUOTA_US / MAX_PERIOD_US:g}, 1]")
        out[str(name)] = value
    return out


def load_fleet(cluster_path: str | Path, catalog_path: str | Path = DEFAULT_CATALOG,
               shares_path: str | Path = DEFAULT_SHARES, cores: float | None = None
               ) -> EmulatedFleet:
    """The cluster with its GPU types' CPU shares; refuses a fleet whose shares do not fit in
    ``cores`` (default: this machine's)."""
    cluster = load_cluster(cluster_path, load_gpu_catalog(catalog_path))
    shares = load_cpu_shares(shares_path)
    for i, node in enumerate(cluster.nodes):
        if node.gpu not in shares:
            raise ConfigError(cluster_path, f"nodes[{i}].gpu", f"GPU type {node.gpu!r} has no "
                              f"CPU share in {shares_path}", ", ".join(sorted(shares)))
    fleet = EmulatedFleet(cluster, {g: shares[g] for g in cluster.gpu_types})
    if len(fleet.zones) > 2:
        raise ConfigError(cluster_path, "nodes", f"nodes in {len(fleet.zones)} zones "
                          f"({', '.join(fleet.zones)})", "nodes in at most two zones (the "
                          "emulation shapes one link between two zones)")
    cores = cores if cores is not None else float(os.cpu_count() or 1)
    if fleet.total_share >= cores:
        raise ConfigError(cluster_path, "nodes", f"the GPUs' CPU shares sum to "
                          f"{fleet.total_share:g} cores, this machine has {cores:g}",
                          f"fewer GPUs or smaller shares (sum < {cores:g})")
    return fleet


def cfs_quota(share: float) -> tuple[int, int]:
    """(cpu.cfs_period_us, cpu.cfs_quota_us) giving ``share`` of one core: a 2 ms quota and the
    period that makes it the share (module doc)."""
    if not QUOTA_US / MAX_PERIOD_US <= share <= 1.0:
        raise ValueError(f"share {share} outside [{QUOTA_US / MAX_PERIOD_US:g}, 1]")
    return round(QUOTA_US / share), QUOTA_US


@dataclass(frozen=True)
class NodeNet:
    node: str
    namespace: str
    device: str           # the node's end of its veth (its NIC)
    bridge_port: str      # the switch's end
    address: str
    rate_mbit: float
    bridge: str           # the switch the node is on (its zone's)


def node_networks(fleet: EmulatedFleet, prefix: str = DEFAULT_PREFIX) -> list[NodeNet]:
    nodes = fleet.cluster.nodes
    if len(nodes) > 250:
        raise ValueError("at most 250 emulated nodes (one /24)")
    bridges = zone_bridges(fleet, prefix)
    # Interface names have at most 15 characters.
    return [NodeNet(n.name, f"{prefix}-n{i}", f"{prefix[:8]}n{i}", f"{prefix[:8]}b{i}",
                    f"{SUBNET}.{i + 1}", fleet.link_mbit(n.name), bridges[n.zone])
            for i, n in enumerate(nodes)]


def zone_bridges(fleet: EmulatedFleet, prefix: str = DEFAULT_PREFIX) -> dict[str | None, str]:
    """Each zone's bridge (zone None: the one bridge of a fleet in one zone or without zones)."""
    zones = fleet.zones
    if len(zones) < 2:
        return {zone: bridge_name(prefix) for zone in zones or [None]}
    return {zone: f"{bridge_name(prefix)}{i}" for i, zone in enumerate(zones)}


@dataclass(frozen=True)
class ZoneLinkNet:
    """The veth pair joining two zones' bridges, each end shaped for what it sends."""
    ends: tuple[str, str]       # in the first zone's bridge, in the second's
    bridges: tuple[str, str]
    rate_mbit: float            # the zone link's bandwidth (GB/s per direction) in Mbit/s
    delay_ms: float             # its latency, one way


def zone_link(fleet: EmulatedFleet, prefix: str = DEFAULT_PREFIX) -> ZoneLinkNet | None:
    """The link between the fleet's two zones; None in one zone or without zones."""
    zones = fleet.zones
    if len(zones) < 2:
        return None
    link = fleet.cluster.zone_link(*zones)
    bridges = zone_bridges(fleet, prefix)
    return ZoneLinkNet((f"{prefix[:8]}za", f"{prefix[:8]}zb"),
                       (bridges[zones[0]], bridges[zones[1]]), link.bandwidth_gbs * 8000.0,
                       link.latency_ms)


def fabric_namespace(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}-fabric"


def bridge_name(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix[:8]}br"


def network_commands(fleet: EmulatedFleet, prefix: str = DEFAULT_PREFIX,
                     queue_ms: float = DEFAULT_QUEUE_MS, delay: bool = True) -> list[list[str]]:
    """Every ip/tc command that builds the fleet's network, in order (``delay`` False: the link
    between zones rate-limited without its latency, on a kernel without netem)."""
    fabric = fabric_namespace(prefix)
    nets = node_networks(fleet, prefix)
    cmds = []
    for ns in [fabric] + [n.namespace for n in nets]:
        cmds += [["ip", "netns", "add", ns], _netns.in_netns(["ip", "link", "set", "lo", "up"], ns)]
    for bridge in zone_bridges(fleet, prefix).values():
        cmds += [_netns.in_netns(["ip", "link", "add", bridge, "type", "bridge"], fabric),
                 _netns.in_netns(["ip", "link", "set", bridge, "up"], fabric)]
    between = zone_link(fleet, prefix)
    if between is not None:
        cmds.append(_netns.veth_cmd(between.ends[0], fabric, between.ends[1], fabric))
        for end, bridge in zip(between.ends, between.bridges):
            cmds += [_netns.in_netns(["ip", "link", "set", end, "master", bridge], fabric),
                     _netns.in_netns(["ip", "link", "set", end, "up"], fabric),
                     # what crosses into the other zone: the link's latency and bandwidth
                     _netns.in_netns(_netns.netem_cmd(end, between.rate_mbit, between.delay_ms)
                                     if delay else
                                     _netns.tbf_cmd(end, between.rate_mbit, queue_ms), fabric)]
    for n in nets:
        cmds += [_netns.veth_cmd(n.device, n.namespace, n.bridge_port, fabric),
                 _netns.in_netns(["ip", "link", "set", n.bridge_port, "master", n.bridge],
                                 fabric),
                 _netns.in_netns(["ip", "link", "set", n.bridge_port, "up"], fabric),
                 _netns.in_netns(["ip", "addr", "add", f"{n.address}/24", "dev", n.device],
                                 n.namespace),
                 _netns.in_netns(["ip", "link", "set", n.device, "up"], n.namespace),
                 # node -> switch (what it sends) and switch -> node (what it receives)
                 _netns.in_netns(_netns.tbf_cmd(n.device, n.rate_mbit, queue_ms), n.namespace),
                 _netns.in_netns(_netns.tbf_cmd(n.bridge_port, n.rate_mbit, queue_ms), fabric)]
    return cmds


def assign_cpus(shares: list[float], cores: int) -> list[int]:
    """A CPU for each process: largest share first, onto the CPU with the most share left (so no
    CPU carries more than a core's worth while another has room). Returns the CPU per process,
    in the order given."""
    left = [1.0] * cores
    cpu = [0] * len(shares)
    for i in sorted(range(len(shares)), key=lambda i: -shares[i]):
        best = max(range(cores), key=lambda c: (left[c], -c))
        cpu[i] = best
        left[best] -= shares[i]
    return cpu


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    node: str
    local_rank: int
    gpu: str
    namespace: str
    device: str
    address: str
    cgroup: Path
    period_us: int
    quota_us: int
    cpu: int


def place_ranks(fleet: EmulatedFleet, ranks: list[tuple[str, int]] | None = None,
                prefix: str = DEFAULT_PREFIX, cgroup_root: Path = CGROUP_CPU_ROOT,
                cores: int | None = None) -> list[Placement]:
    """Rank -> (namespace, cgroup, CPU): ``ranks`` lists (node, local GPU) per global rank (a
    plan's rank order); None: every device of the cluster in its own order. CPUs: of every
    device of the cluster (:func:`assign_cpus`), so a GPU keeps its CPU whatever plan runs."""
    cluster = fleet.cluster
    all_devices = cluster.devices()
    cpus = assign_cpus([fleet.cpu_share[d.gpu] for d in all_devices],
                       cores or os.cpu_count() or 1)
    cpu_of = {(d.node, d.local_rank): c for d, c in zip(all_devices, cpus)}
    devices = {(d.node, d.local_rank): d for d in cluster.devices()}
    if ranks is None:
        ranks = [(d.node, d.local_rank) for d in cluster.devices()]
    nets = {n.node: n for n in node_networks(fleet, prefix)}
    seen, out = set(), []
    for rank, key in enumerate(ranks):
        if key not in devices:
            raise ConfigError("<plan>", f"ranks[{rank}]", f"node {key[0]!r} GPU {key[1]} is not "
                              f"a GPU of cluster {cluster.name!r}",
                              "a plan made for this cluster")
        if key in seen:
            raise ConfigError("<plan>", f"ranks[{rank}]", f"node {key[0]!r} GPU {key[1]} has two "
                              "ranks", "one rank per GPU")
        seen.add(key)
        device, net = devices[key], nets[key[0]]
        period, quota = cfs_quota(fleet.cpu_share[device.gpu])
        out.append(Placement(rank, len(ranks), device.node, device.local_rank, device.gpu,
                             net.namespace, net.device, net.address,
                             rank_cgroup(prefix, rank, cgroup_root), period, quota,
                             cpu_of[key]))
    return out


def rank_env(p: Placement, master: Placement, port: int) -> dict[str, str]:
    """The torchrun-style environment of one rank, plus what gloo, torch and a plan switch's
    store (its node's address: the host name resolves outside the namespaces) need here."""
    return {"RANK": str(p.rank), "WORLD_SIZE": str(p.world_size), "LOCAL_RANK": str(p.local_rank),
            "MASTER_ADDR": master.address, "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": p.device, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "AUTOHET_EMULATED_GPU": p.gpu,
            # where a rank that hosts the next plan's store (an in-process re-plan) is reached
            "AUTOHET_LOCAL_ADDR": p.address}


def confined_command(p: Placement, cmd: list[str]) -> list[str]:
    """``cmd`` on the rank's CPU, in its namespace, joined to its cgroup before it execs (module
    doc). The cgroup first: ``ip netns exec`` mounts the namespace's own /sys, without
    /sys/fs/cgroup; ``taskset`` and ``ip netns exec`` exec in place, so the command keeps the pid
    the wrapper joined."""
    join = f"echo $$ > {shlex.quote(str(p.cgroup / 'tasks'))} && exec \"$@\""
    return ["sh", "-c", join, "sh", "taskset", "-c", str(p.cpu),
            *_netns.in_netns(cmd, p.namespace)]


def write_quota(cgroup: Path, period_us: int, quota_us: int) -> None:
    """Set a cgroup's CFS quota (v1: ``cpu.cfs_period_us``, ``cpu.cfs_quota_us``); the kernel
    applies it to the processes in it at once, so a running rank slows or recovers in place."""
    (cgroup / "cpu.cfs_period_us").write_text(str(period_us))
    (cgroup / "cpu.cfs_quota_us").write_text(str(quota_us))


def set_share(cgroup: Path, share: float) -> tuple[int, int]:
    """Give the emulated GPU of ``cgroup`` ``share`` of one core from now on (a straggler:
    its type's share times its speed); returns (period, quota) written."""
    period, quota = cfs_quota(share)
    write_quota(cgroup, period, quota)
    return period, quota


def rank_cgroup(prefix: str, rank: int, cgroup_root: Path = CGROUP_CPU_ROOT) -> Path:
    """The cgroup of a running emulation's rank (:func:`place_ranks`' naming)."""
    return cgroup_root / prefix / f"rank{rank}"


# ---- what was created, and its removal -----------------------------------------------------------

@dataclass
class Ledger:
    """Everything a run created, in creation order; :meth:`teardown` removes it in reverse (each
    entry once, whatever fails) so a later resource never outlives one it depends on."""

    entries: list[tuple[str, str]] = field(default_factory=list)

    def add(self, kind: str, name: str) -> None:
        self.entries.append((kind, name))

    def teardown(self, remove) -> list[str]:
        """Call ``remove(kind, name)`` newest first; returns the errors (the rest still goes)."""
        errors = []
        while self.entries:
            kind, name = self.entries.pop()
            try:
                remove(kind, name)
            except Exception as exc:  # noqa: BLE001 - keep removing the rest
                errors.append(f"{kind} {name}: {exc}")
        return errors


def stale_resources(prefix: str, namespaces: list[str], cgroups: list[Path],
                    cgroup_root: Path = CGROUP_CPU_ROOT) -> list[tuple[str, str]]:
    """What an earlier run with ``prefix`` left (killed before its clean-up): namespaces and
    cgroups carrying the prefix, in removal order (processes' cgroups before their parent)."""
    mine = [("netns", ns) for ns in namespaces if ns.startswith(f"{prefix}-")]
    parent = cgroup_root / prefix
    groups = [("cgroup", str(c)) for c in cgroups if c.parent == parent]
    if parent in cgroups:
        groups.append(("cgroup", str(parent)))
    return groups + mine


# ---- side effects --------------------------------------------------------------------------------

class EmulatedCluster:
    """Build the fleet's network and cgroups; start confined rank processes; remove it all.

    Use as a context manager; ``__exit__`` (also reached on Ctrl-C and, through
    :func:`raise_on_sigterm`, on SIGTERM) kills every process started and tears down.
    """

    def __init__(self, fleet: EmulatedFleet, prefix: str = DEFAULT_PREFIX,
                 queue_ms: float = DEFAULT_QUEUE_MS):
        self.fleet, self.prefix, self.queue_ms = fleet, prefix, queue_ms
        self.ledger = Ledger()
        self.procs: list[subprocess.Popen] = []
        self.networks = {n.node: n for n in node_networks(fleet, prefix)}
        self.zone_delay = True      # whether the zone link's latency is emulated (netem)

    def __enter__(self) -> "EmulatedCluster":
        self.remove_stale()
        delay = True
        if zone_link(self.fleet, self.prefix) is not None:
            delay = _netns.has_netem(f"{self.prefix}-probe")
            if not delay:
                print(f"WARNING: this kernel has no netem (CONFIG_NET_SCH_NETEM): the link "
                      f"between the zones is limited to its bandwidth, its "
                      f"{zone_link(self.fleet, self.prefix).delay_ms:g} ms of latency are not "
                      "emulated", file=sys.stderr, flush=True)
        self.zone_delay = delay
        try:
            for cmd in network_commands(self.fleet, self.prefix, self.queue_ms, delay):
                if cmd[:3] == ["ip", "netns", "add"]:
                    self.ledger.add("netns", cmd[3])    # recorded first: a half-made one goes too
                _netns.run(cmd)
            parent = CGROUP_CPU_ROOT / self.prefix
            parent.mkdir()
            self.ledger.add("cgroup", str(parent))
            (parent / "cpu.shares").write_text(str(PRIORITY_SHARES))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cgroup(self, path: Path, period_us: int, quota_us: int) -> Path:
        """A cgroup under this run's parent with that quota (created once; the quota written
        every time: a later plan may put another GPU type's rank, or a restored straggler, in
        it)."""
        if not path.exists():
            path.mkdir()
            self.ledger.add("cgroup", str(path))
        write_quota(path, period_us, quota_us)
        return path

    def spawn(self, p: Placement, cmd: list[str], env: dict[str, str],
              log: Path | None = None) -> subprocess.Popen:
        """Start ``cmd`` as rank ``p``: in its namespace and cgroup, in a session of its own."""
        self.cgroup(p.cgroup, p.period_us, p.quota_us)
        out = open(log, "w") if log else None
        try:
            proc = subprocess.Popen(confined_command(p, cmd), env={**os.environ, **env},
                                    stdout=out, stderr=subprocess.STDOUT if out else None,
                                    start_new_session=True)
        finally:
            if out:
                out.close()
        self.procs.append(proc)
        self.ledger.add("process", str(proc.pid))
        return proc

    def launch(self, placements: list[Placement], cmd: list[str], port: int,
               logs: Path | None = None) -> list[subprocess.Popen]:
        """One process per placement, each with its rank's environment."""
        return [self.spawn(p, cmd, rank_env(p, placements[0], port),
                           logs / f"rank{p.rank}.log" if logs else None) for p in placements]

    def close(self) -> None:
        errors = self.ledger.teardown(self._remove)
        self.procs.clear()
        for e in errors:
            print(f"emulate_cluster: clean-up: {e}", file=sys.stderr)

    def remove_stale(self) -> None:
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True,
                                    text=True).stdout.split()
        parent = CGROUP_CPU_ROOT / self.prefix
        cgroups = ([c for c in parent.iterdir() if c.is_dir()] + [parent]
                   if parent.is_dir() else [])
        for kind, name in stale_resources(self.prefix, namespaces, cgroups):
            self._remove(kind, name)

    def _remove(self, kind: str, name: str) -> None:
        if kind == "process":
            proc = next((p for p in self.procs if p.pid == int(name)), None)
            if proc is not None and proc.poll() is None:
                _stop_session(proc)
        elif kind == "cgroup":
            path = Path(name)
            if path.is_dir():
                _empty_cgroup(path)
                path.rmdir()
        elif kind == "netns":
            _netns.delete_namespace(name)


def _stop_session(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM the process's session (it and its children), SIGKILL what is left after grace:
    the process if it has not ended, and the session's other processes either way (a child
    that outlives its parent, or ignores SIGTERM, would otherwise run on unseen)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait()


def _empty_cgroup(path: Path) -> None:
    """Kill what is still in one of our cgroups (a child that left its session), so it can go."""
    for _ in range(50):
        pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def raise_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so ``with EmulatedCluster(...)`` cleans up on both."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


def wait_all(procs: list[subprocess.Popen], timeout_s: float | None = None) -> int:
    """Wait for every process; on the first failure stop waiting. Returns 0 or the first
    failing exit status (124 on timeout); the caller's clean-up stops the rest."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            return 124
        time.sleep(0.1)


def require_root() -> None:
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("needs root and iproute2 (ip, tc) to build namespaces and shaped links")
    if not (CGROUP_CPU_ROOT / "cpu.cfs_quota_us").exists():
        raise SystemExit(f"needs cgroup v1's cpu controller at {CGROUP_CPU_ROOT}")


def parse_share(text: str) -> tuple[int, float]:
    """``RANK=SHARE`` of --set-share; ConfigError naming the flag otherwise."""
    rank, sep, share = text.partition("=")
    try:
        if not sep:
            raise ValueError
        parsed = int(rank), float(share)
        cfs_quota(parsed[1])
    except ValueError:
        raise ConfigError("<command line>", "--set-share", f"got {text!r}",
                          f"RANK=SHARE, a rank number and a fraction of one core in "
                          f"[{QUOTA_US / MAX_PERIOD_US:g}, 1]") from None
    return parsed


def set_shares_cli(values: list[str], prefix: str, cmd: list[str],
                   cgroup_root: Path = CGROUP_CPU_ROOT) -> int:
    """--set-share: rewrite the quotas of running ranks (0), or one error line (2)."""
    try:
        if cmd:
            raise ConfigError("<command line>", "--set-share", "given with a command",
                              "--set-share alone (it changes a running emulation)")
        shares = [parse_share(v) for v in values]
        for rank, _ in shares:
            if not (rank_cgroup(prefix, rank, cgroup_root) / "cpu.cfs_quota_us").exists():
                raise ConfigError("<command line>", "--set-share",
                                  f"rank {rank} has no cgroup under "
                                  f"{cgroup_root / prefix}", "a rank of a running emulation "
                                  "with this --prefix")
    except ConfigError as err:
        print(f"emulate_cluster: error: {err}", file=sys.stderr)
        return 2
    for rank, share in shares:
        period, quota = set_share(rank_cgroup(prefix, rank, cgroup_root), share)
        print(f"rank {rank}: {share:.3g} of a core ({quota} us per {period} us)", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", metavar="C.yaml",
                        help="emulated cluster (configs/emulated/*.yaml); required unless "
                             "--set-share")
    parser.add_argument("--set-share", action="append", default=[], metavar="RANK=SHARE",
                        help="change the CPU share (fraction of one core) of rank RANK of the "
                             "running emulation with --prefix, now, and exit: a straggler "
                             "(half its type's share) or its recovery (the type's share); "
                             "repeatable")
    parser.add_argument("--gpu-catalog", default=str(DEFAULT_CATALOG), metavar="G.yaml",
                        help="catalog of the emulated GPU types (default: %(default)s)")
    parser.add_argument("--cpu-shares", default=str(DEFAULT_SHARES), metavar="S.yaml",
                        help="CPU share per emulated GPU type (default: %(default)s)")
    parser.add_argument("--plan", default=None, metavar="P.yaml",
                        help="start one process per rank of this plan, placed as it says "
                             "(default: one per GPU of the cluster)")
    parser.add_argument("--port", type=int, default=29600, help="MASTER_PORT (default 29600)")
    parser.add_argument("--queue-ms", type=float, default=DEFAULT_QUEUE_MS,
                        help="longest a packet waits in a shaped link's queue (default 20)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help="names of the namespaces and cgroups (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds (default: none)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- the command each rank runs")
    args = parser.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.set_share:
        return set_shares_cli(args.set_share, args.prefix, cmd)
    try:
        if args.cluster is None:
            raise ConfigError("<command line>", "--cluster", "missing",
                              "an emulated cluster file (or --set-share RANK=SHARE)")
        if not cmd:
            raise ConfigError("<command line>", "command", "missing", "-- CMD ARGS...")
        fleet = load_fleet(args.cluster, args.gpu_catalog, args.cpu_shares)
        ranks = None
        if args.plan:
            from megatron_autohet.plan import load_plan
            ranks = [(r.node, r.local_rank) for r in load_plan(args.plan).ranks]
        placements = place_ranks(fleet, ranks, args.prefix)
    except ConfigError as err:
        print(f"emulate_cluster: error: {err}", file=sys.stderr)
        return 2
    require_root()
    raise_on_sigterm()
    try:
        with EmulatedCluster(fleet, args.prefix, args.queue_ms) as emu:
            for p in placements:
                print(f"rank {p.rank}: {p.gpu} on {p.node} ({p.namespace}, {p.address}), "
                      f"{p.quota_us / p.period_us:.3g} of CPU {p.cpu}", flush=True)
            return wait_all(emu.launch(placements, cmd, args.port), args.timeout)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
