"""A spot fleet emulated on one machine: each node a real `autohet node` (torchrun agent) process.

Used by the elastic tests, ``scripts/bench_spot.py`` and the quick start. Everything runs as it
would on a fleet - `autohet rendezvous`, one `autohet node` and one `autohet watch` per node,
node-local checkpoint directories - only the nodes share this machine: each gets its own
loopback address (``127.0.0.N``), its own directory (``WORKDIR/<node>/``) and CPU workers.

* :meth:`EmulatedFleet.add` starts a node (a node joining the job);
* :meth:`EmulatedFleet.preempt` sends its watcher SIGTERM, as Kubernetes would (the watcher
  writes the notice; the job saves, moves the node's files and lets it go), then reclaims the
  machine once its workers left (:meth:`EmulatedFleet.reclaim_when_left`, also for a notice from
  a cloud's fake metadata server);
* :meth:`EmulatedFleet.kill` kills the node's whole process tree with SIGKILL, as a lost
  machine (no notice).

The job's events and metrics (JSON lines) are in ``WORKDIR/events.jsonl`` and
``WORKDIR/metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_autohet.system.ports import free_port


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _workers(agent: int) -> list[int]:
    """The worker processes of a node's agent: its children but its warm fork server (each
    worker the server forked keeps its client, a child of the agent, until it ends)."""
    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""
    return [p for p in _children().get(agent, []) if b"--serve" not in cmdline(p)]


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants now (torchrun's workers run in their own session, so a
    process group would miss them)."""
    tree = _children()
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += tree.get(found[-1], [])
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants. Stops them first so none can respawn
    meanwhile."""
    doomed = process_tree(pid)
    for p in doomed:
        try:
            os.kill(p, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    for p in doomed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class _Node:
    name: str
    process: subprocess.Popen
    watcher: subprocess.Popen
    log: Path


@dataclass
class EmulatedFleet:
    workdir: Path
    train_args: list[str]              # `autohet train` arguments (plan, model, cluster, iters...)
    nnodes: str = "2:8"
    job_id: str = "emulated"
    port: int = 0
    omp_threads: int = 1
    cold_workers: bool = False         # `autohet node --cold-workers`: no warm fork server
    loss_timeout: float | None = None  # `autohet node --loss-timeout` (None: its default, 20 s)
    nodes: dict[str, _Node] = field(default_factory=dict)
    _rendezvous: subprocess.Popen | None = None
    _next_addr: int = 1

    def __post_init__(self):
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)

    # ---- files ----------------------------------------------------------------------------
    @property
    def events_path(self) -> Path:
        return self.workdir / "events.jsonl"

    @property
    def metrics_path(self) -> Path:
        return self.workdir / "metrics.jsonl"

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in read_jsonl(self.events_path) if kind is None or e["event"] == kind]

    def metrics(self) -> list[dict]:
        return read_jsonl(self.metrics_path)

    def notice_file(self, node: str) -> Path:
        return self.workdir / node / "notice.json"

    # ---- processes ----------------------------------------------------------------------------
    def _autohet(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "megatron_autohet.cli.main", *args]

    def start(self) -> None:
        self.port = self.port or free_port()
        self._rendezvous = subprocess.Popen(
            self._autohet("rendezvous", "--host", "127.0.0.1", "--port", str(self.port)),
            stdout=open(self.workdir / "rendezvous.log", "w"), stderr=subprocess.STDOUT)

    def add(self, node: str, gpu: str, *, cloud: tuple[str, str] | None = None) -> None:
        """Start a node: its watcher and its `autohet node` agent. The watcher always takes
        signals; ``cloud`` = (source, metadata URL) adds a cloud's notices (a test's fake
        metadata server, polled every 0.2 s)."""
        (self.workdir / node).mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"{node}.log"
        out = open(log, "a")
        notice = self.workdir / "{node}" / "notice.json"
        sources = ["--source", "signal"]
        if cloud is not None:
            sources += ["--source", cloud[0], "--metadata-url", cloud[1], "--poll-interval",
                        "0.2"]
        watcher = subprocess.Popen(
            self._autohet("watch", *sources, "--notice-file", str(self.notice_file(node)),
                          "--signal-grace", "30",
                          "--events-jsonl", str(self.workdir / node / "notices.jsonl")),
            stdout=out, stderr=subprocess.STDOUT)
        env = dict(os.environ, OMP_NUM_THREADS=str(self.omp_threads), CUDA_VISIBLE_DEVICES="")
        # 127.0.0.N, then on through 127.0.0.0/8 (all loopback on Linux): one per start, a
        # restarted node included, so a long replay may need more than 254
        n = self._next_addr
        addr = f"127.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
        self._next_addr += 1
        process = subprocess.Popen(
            self._autohet("node", "--rendezvous", f"127.0.0.1:{self.port}", "--job-id",
                          self.job_id, "--nnodes", self.nnodes, "--node-name", node,
                          "--gpu", gpu, "--local-addr", addr, "--notice-file",
                          str(self.notice_file(node)),
                          *(["--cold-workers"] if self.cold_workers else []),
                          *([] if self.loss_timeout is None
                            else ["--loss-timeout", f"{self.loss_timeout:g}"]), "--",
                          *self.train_args,
                          "--autohet-local-ckpt-dir", str(self.workdir / "{node}" / "ckpt"),
                          "--autohet-notice-file", str(notice),
                          "--autohet-events-jsonl", str(self.events_path),
                          "--metrics-jsonl", str(self.metrics_path)),
            stdout=out, stderr=subprocess.STDOUT, env=env)
        self.nodes[node] = _Node(node, process, watcher, log)

    def preempt(self, node: str, *, deadline_s: float = 120.0) -> bool:
        """A preemption with notice: SIGTERM to the node's watcher (as Kubernetes sends it), then
        :meth:`reclaim_when_left`."""
        self.nodes[node].watcher.send_signal(signal.SIGTERM)
        return self.reclaim_when_left(node, deadline_s=deadline_s)

    def reclaim_when_left(self, node: str, *, deadline_s: float = 120.0) -> bool:
        """After a notice: once the job has saved and the node's workers have left, the machine
        is reclaimed (its process tree killed), at the latest at the deadline. True when the
        workers had left by then."""
        entry = self.nodes[node]
        deadline = time.monotonic() + deadline_s
        left = False
        while time.monotonic() < deadline:
            # The agent waits in torchrun's exit barrier once its workers are gone; its warm
            # fork server (megatron_autohet/cli/warm.py) stays until the agent ends.
            if entry.process.poll() is not None or not _workers(entry.process.pid):
                left = True
                break
            time.sleep(0.05)
        self.kill(node)
        return left

    def kill(self, node: str) -> None:
        """A node lost without notice: its whole process tree gets SIGKILL."""
        entry = self.nodes.pop(node)
        kill_tree(entry.process.pid)
        entry.process.wait()
        entry.watcher.kill()
        entry.watcher.wait()

    def wait_for(self, predicate, *, timeout: float, what: str, poll: float = 0.1) -> None:
        """Until ``predicate()`` holds; a node that exits with an error or the timeout (a safety
        net, not a measurement) raises with the logs' tails."""
        deadline = time.monotonic() + timeout
        while not predicate():
            for entry in self.nodes.values():
                code = entry.process.poll()
                if code not in (None, 0):
                    raise RuntimeError(f"{entry.name} exited with {code} while waiting for "
                                       f"{what}:\n{self.tail(entry.name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout:.0f} s:\n" +
                                   "\n".join(self.tail(n) for n in self.nodes))
            time.sleep(poll)

    def iteration(self) -> int:
        """The newest iteration the job has logged."""
        records = self.metrics()
        return records[-1]["iteration"] if records else 0

    def wait_all(self, *, timeout: float) -> dict[str, int]:
        """Until every node's agent has exited; their statuses."""
        deadline = time.monotonic() + timeout
        codes = {}
        for name, entry in list(self.nodes.items()):
            try:
                codes[name] = entry.process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{name} still running after {timeout:.0f} s:\n"
                                   + self.tail(name)) from None
            entry.watcher.kill()           # SIGTERM would make it write a notice
            entry.watcher.wait(timeout=10)
            del self.nodes[name]
        return codes

    def tail(self, node: str, lines: int = 30) -> str:
        log = self.workdir / f"{node}.log"
        text = log.read_text(errors="replace").splitlines() if log.exists() else []
        keep = [t for t in text if "warn" not in t.lower()]
        return f"--- {node} ---\n" + "\n".join(keep[-lines:])

    def close(self) -> None:
        for name in list(self.nodes):
            self.kill(name)
        if self._rendezvous is not None:
            self._rendezvous.terminate()
            self._rendezvous.wait(timeout=10)
            self._rendezvous = None

    def __enter__(self) -> "EmulatedFleet":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
