"""Network namespaces, veth pairs, a bridge and token-bucket shaping: what the benchmarks that
emulate nodes on one machine share (imported from scripts/, the directory they run from).

Every function runs ``ip`` / ``tc`` (iproute2, needs root); the command lists come from pure
functions (``*_cmd``), so what a bench builds can be checked without root. A failing command
stops the bench with the command and its error.

Rates. netem is not in every kernel (not in this development VM's); tbf is, so an emulated link is
slow in bandwidth, not in latency.
"""

from __future__ import annotations

import subprocess


def in_netns(cmd: list[str], netns: str | None) -> list[str]:
    """``cmd`` run inside network namespace ``netns`` (None: this one)."""
    return (["ip", "netns", "exec", netns] if netns else []) + list(cmd)


def run(cmd: list[str], netns: str | None = None) -> None:
    full = in_netns(cmd, netns)
    result = subprocess.run(full, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(full)} failed: {result.stderr.strip()}")


def tbf_burst_bytes(rate_mbit: float) -> int:
    """The bucket must hold at least a GSO packet (64 KiB) and a couple of ms at the rate, or the
    filter, not the rate, limits throughput."""
    return max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))


def tbf_cmd(dev: str, rate_mbit: float, queue_ms: float, burst_bytes: int | None = None
            ) -> list[str]:
    """Shape ``dev``'s egress to ``rate_mbit``; a packet waits at most ``queue_ms`` in the queue."""
    burst = tbf_burst_bytes(rate_mbit) if burst_bytes is None else burst_bytes
    return ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
            "burst", str(burst), "latency", f"{queue_ms}ms"]


def netem_cmd(dev: str, rate_mbit: float, delay_ms: float) -> list[str]:
    """Delay every packet ``dev`` sends by ``delay_ms`` and send at most ``rate_mbit``: a link
    between zones, one way. The queue holds twice what the link carries in its delay (and at
    least netem's default 1000 packets), so it drops nothing a sender in flight can send."""
    in_flight = rate_mbit * 1e6 / 8 * delay_ms / 1e3 / 1500
    limit = max(1000, int(2 * in_flight))
    return ["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{delay_ms}ms", "rate",
            f"{rate_mbit}mbit", "limit", str(limit)]


def has_netem(probe_ns: str) -> bool:
    """Whether this kernel has netem (sch_netem; some, a Firecracker VM's among them, are built
    without it): tried on the loopback of a scratch namespace ``probe_ns``, removed after."""
    subprocess.run(["ip", "netns", "add", probe_ns], capture_output=True)
    try:
        return subprocess.run(in_netns(["tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                        "delay", "1ms"], probe_ns),
                              capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "delete", probe_ns], capture_output=True)


def veth_cmd(a: str, ns_a: str, b: str, ns_b: str) -> list[str]:
    """A veth pair with end ``a`` in ``ns_a`` and end ``b`` in ``ns_b``."""
    return ["ip", "link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b, "netns", ns_b]


def add_namespace(ns: str) -> None:
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "set", "lo", "up"], netns=ns)


def delete_namespace(ns: str) -> bool:
    """Delete ``ns`` (its ends of veths go with it, and so the pairs; a bridge in it too); False
    when there was none."""
    return subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode == 0


def add_veth(a: str, ns_a: str, b: str, ns_b: str) -> None:
    run(veth_cmd(a, ns_a, b, ns_b))


def shape(dev: str, ns: str, rate_mbit: float, queue_ms: float,
          burst_bytes: int | None = None) -> None:
    run(tbf_cmd(dev, rate_mbit, queue_ms, burst_bytes), netns=ns)


def add_bridge(name: str, ns: str) -> None:
    run(["ip", "link", "add", name, "type", "bridge"], netns=ns)
    run(["ip", "link", "set", name, "up"], netns=ns)


def attach_to_bridge(port: str, bridge: str, ns: str) -> None:
    run(["ip", "link", "set", port, "master", bridge], netns=ns)
    run(["ip", "link", "set", port, "up"], netns=ns)


def address_up(dev: str, ns: str, address: str, prefix: int = 24) -> None:
    run(["ip", "addr", "add", f"{address}/{prefix}", "dev", dev], netns=ns)
    run(["ip", "link", "set", dev, "up"], netns=ns)
