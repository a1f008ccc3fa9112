#!/usr/bin/env python
"""Benchmark an elastic job on an emulated spot fleet replaying a preemption trace, against a
restart-everything-from-S3 baseline on the same trace and a run without events in the same run.

Both runs train the tiny GPT (configs/models/tiny.yaml) with the cluster file
configs/clusters/spot-4.yaml, each node a real `autohet node` (torchrun agent, CPU workers) +
`autohet watch` on this machine (megatron_autohet/testing/emulate.py), with checkpoints every
``--save-interval`` iterations to the nodes' disks and to S3 (moto's server, started here, in
this process). The trace (``ms,add|remove,node[,notice|no-notice]``, megatron_autohet/elastic/
trace.py; events at 0 ms are the starting fleet; default configs/traces/churn-4node-5h.csv, the
churn of a public spot trace) is replayed step by step - all events of one millisecond together
(one reclaim takes several VMs) - with its clock compressed: the gap between two steps, ``ms``
apart, becomes ``ms / 1000 * --time-scale`` seconds of *training* (``--clock training``, the
default): the clock starts at the job's first iteration and stops from a step until the job's
first iteration after it, so every step comes after the same training time in both runs
whatever their downtimes. ``--clock wall`` delivers each step at ``ms / 1000 * --time-scale``
after the first iteration instead; one due while the job is still down waits until it trains
again, and the delay is reported (``late``).

**A join pauses the clock and the job** until the joiner is in the job (a ``fleet`` event
listing it, then the job's first iteration after that: its first round done): the job is held
at the next iteration boundary (elastic/hold.py's hold file, ``AUTOHET_HOLD_FILE`` in the
nodes' environment; torchrun's SIGTERM when the joiner arrives releases it, the stop lands
after the held iteration), the hold is lifted once the joiner trains (or after JOIN_TIMEOUT,
recorded), and the clock restarts at the joiner's first iteration. Why a pause and not an
``--iters`` derived from the trace: a joiner here warms up for about a minute (torch imports
on the machine's shared cores; a trace's ``add`` is a node ready to join, its boot is not in
the trace), during which the job trained on off the trace's clock (the clock already stopped
from the step to the next first iteration) - hundreds of iterations per join, so ``--iters``
had to grow with a trace's joins; deriving it would need the iteration time and the warm-up
time under the machine's load, known only after the runs. Held, the job trains only on the
trace's clock, so ``--iters`` is about that clock's seconds (printed at the start) over the
iteration time, whatever the joins. The held seconds (the held iteration's end to the
joiner's stop) are off the run's wall time too (``held_s``), as they are no part of the trace.
The baseline restarts everything on a join anyway (no hold).

**Any node count the machine holds:** torchrun's ``--nnodes`` is the trace's (2 or the fewest
nodes it goes down to, up to the most it has up at once; was 2:8), each start of a node a new
loopback address (127.0.0.N, then on through 127.0.0.0/8: the emulated nodes are processes,
no namespaces). A trace whose largest fleet needs more than the machine has at
``--cpu-per-node`` (default 0.1 cores) or ``--mem-per-node-gb`` (default 1, of MemAvailable)
is refused in one line, naming the flag and the limit.

**Every** ``autohet node`` gets ``--loss-timeout`` (default the product's, 20 s: a node lost
without notice is found that long after; the kill figures in docs/spot.md were measured with
the old 3 s expiry); each run's row records it.

**A row per run:** after each run its analysis is printed and appended to ``runs`` in the JSON
file, which is rewritten (``complete`` false until the summary is written at the end), so a
bench stopped early keeps what it measured. **SIGTERM / SIGINT:** the running fleet is torn
down (every node's process tree and watcher killed, the rendezvous ended; moto's server
stopped), the rows so far are kept (``interrupted``: the signal and the runs done) and the
script exits with 128 + the signal (143, 130).

* **autohet**: a removal with notice (the trace's fourth column; ``notice`` where it says
  nothing) is ``EmulatedFleet``'s preemption: SIGTERM to the node's watcher (every notice of a
  step first), the job saves the iteration in flight, moves the node's files to the others, the
  node leaves, the survivors re-plan and recover from disks/peers/S3. A removal without notice
  (``no-notice``, or every removal with ``--no-notice``) kills the node's process tree
  (SIGKILL). An ``add`` is a node joining.
* **baseline** (restart everything from S3, Varuna-style checkpoint/restart): the same product
  code, but on every step every node's process tree is killed with SIGKILL (a job without
  notice handling: no emergency save), every node-local checkpoint directory is deleted, and the
  job is started again on the new fleet (a new rendezvous id, ``--nnodes N:N``) with cold
  workers (``autohet node --cold-workers``: torchrun's fresh interpreters, as a restarted job
  without warm fork servers has). Recovery then reads everything from S3: the newest step whose
  upload had completed; the iterations after it are lost and re-trained. The restart is
  immediate (an omniscient job manager).
* **no events** (the reference; ``--no-reference`` skips it): the autohet run's code path with
  an empty trace - the same starting fleet, iterations, save interval and checkpoint tiers, so
  it pays every save, log line and upload the other two pay, and nothing else.

Nothing a fleet does ends the benchmark: an agent that exits while its node is in the fleet is
recorded and started again (as scripts/launch_node.sh does), a job that does not train again
within EVENT_TIMEOUT is recorded and the rest of the trace skipped, and the analysis reports
what the job's files show (a missing event is a "-", never an exception). A step that only gives
notice to nodes the plan in force leaves idle (its newest ``plan`` event's ``idle``) stops no
training: the replay does not wait for the job to train again (no first iteration follows), the
training clock runs on through it, and it costs no downtime.

Per step, from the events (``WORKDIR/<run>/events.jsonl``, ``time_unix``) and the iteration log
(``metrics.jsonl``, ``elapsed_ms`` per iteration), with ``t`` the time the benchmark delivered it:

* ``detect``: t -> the job's ``stop`` event (the iteration in flight done; notice or join only);
* ``save``: stop -> ``evacuate`` event (emergency save and the leaving node's files moved);
* ``restart``: the old round's end (evacuate, else stop, else t for a kill) -> rank 0 starts
  agreeing on a plan (``plan.time_unix - plan.seconds``): the old workers' exit, agents,
  rendezvous, new workers' start-up (Python + torch imports), for a join the save too;
* ``re-plan``: the plan event's ``seconds`` (waiting for every worker's member record included);
* ``setup``: plan -> recovery starts (process group, model, optimizer, data);
* ``recover``: the recovery event's seconds (sum of its phases; bytes per tier in the JSON);
* ``1st it``: the first iteration after the restart (``elapsed_ms``), not counted in downtime;
* ``down``: training stopped (stop event, or t for a kill) -> the first iteration after the
  restart starts. Equals save + restart + re-plan + setup + recover (+ a few ms between them);
  for a join, ``detect`` includes the joiner's warm-up and the hold, ``down`` neither;
* ``lost``: iterations trained before the step and not in the checkpoint recovered (re-trained),
  and their cost (``lost s``: lost x the run's median iteration time); ``cost`` = down + lost s.

Per kind of step (notice, kill, join, restart-all, or several kinds at once such as
``kill+notice``): downtime mean and max, iterations lost. Per run: wall time from the first
iteration to the ``finished`` event, the fraction of it spent in iterations (``busy``) and in
iterations that were not re-trained (``useful``), the iterations kept times the job's own
median iteration time over that wall time (``at median``: 1.0 never stopped, never re-trained,
never saved), the ``rate`` (iterations kept per second of that wall time) and the ``goodput``:
the rate over the no-event run's rate (what the events cost, the saves not; the target is >= 70%).
The wall time leaves out the join holds (``held_s``).

    python scripts/bench_spot.py [--quick] [--trace configs/traces/churn-4node-5h.csv]
        [--time-scale 0.02] [--iters 3000] [--clock training|wall] [--save-interval 10]
        [--no-notice] [--no-reference] [--loss-timeout 20] [--cpu-per-node 0.1]
        [--mem-per-node-gb 1] [--workdir DIR] [--out bench-out/bench-spot.json]

CPU only; every process shares this machine's cores, so start-up (torch imports) weighs far
more than on a real fleet; the JSON records the core count and load average.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import silence_known_megatron_warnings, write_json

from megatron_autohet.elastic.liveness import DEFAULT_LOSS_TIMEOUT_S, check_loss_timeout
from megatron_autohet.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

MODEL = ROOT / "configs/models/tiny.yaml"
CHURN_TRACE = ROOT / "configs/traces/churn-4node-5h.csv"
QUICK_TRACE = ROOT / "configs/traces/synthetic-4node.csv"
CLUSTER = ROOT / "configs/clusters/spot-4.yaml"
GLOBAL_BATCH, MICRO_BATCH = 8, 1
START_TIMEOUT, EVENT_TIMEOUT = 600.0, 600.0      # safety nets, not measurements
EXIT_TIMEOUT = 60.0          # the agents' exit after the job (each one's time is recorded)
RESTART_DELAY_S = 1.0        # an agent that exited is started again after this (launch_node.sh)
NO_EVENTS = "no-events"      # the reference run's mode: autohet's code path, an empty trace
JOIN_TIMEOUT = 300.0         # a joiner not in the job by then: the hold is lifted, recorded
# What one emulated node needs at least (the refusal of a trace this machine cannot hold):
# its worker (one torch thread), agent, warm fork server and watcher.
CPU_PER_NODE = 0.1           # cores: the agents poll every 0.1 s and renew keep-alives each s
MEM_PER_NODE_GB = 1.0        # GB resident: an estimate (three torch processes), not measured


def autohet(*args) -> None:
    done = subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", *map(str, args)],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"autohet {' '.join(map(str, args))} failed:\n{done.stderr[-3000:]}")


def warm_data_cache(iters: int) -> None:
    """Build the corpus and the sample index for this many iterations once, before either run,
    so neither pays for it (both use the default cache)."""
    code = ("from megatron_autohet.data.batches import DataOptions, build_global_batches\n"
            "from megatron_autohet.spec.model import load_model\n"
            f"m = load_model({str(MODEL)!r})\n"
            f"build_global_batches(DataOptions(seq_length=m.seq_length, global_batch_size="
            f"{GLOBAL_BATCH}, num_iterations={iters}), m.vocab_size)\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


class GpuTypes:
    """A node's GPU type: its entry in the cluster file, else the type of a node the trace
    removed and nobody has replaced yet (a replacement), else the file's types in turn."""

    def __init__(self, cluster_path: Path):
        from megatron_autohet.spec.cluster import load_cluster

        cluster = load_cluster(cluster_path)
        self.by_name = {n.name: n.gpu for n in cluster.nodes}
        self.types = list(dict.fromkeys(n.gpu for n in cluster.nodes))
        self.freed: list[str] = []
        self.assigned: dict[str, str] = {}
        self._next = 0

    def removed(self, node: str) -> None:
        self.freed.append(self.of(node))

    def of(self, node: str) -> str:
        if node not in self.assigned:
            if node in self.by_name:
                gpu = self.by_name[node]
                if gpu in self.freed:
                    self.freed.remove(gpu)
            elif self.freed:
                gpu = self.freed.pop(0)
            else:
                gpu = self.types[self._next % len(self.types)]
                self._next += 1
            self.assigned[node] = gpu
        return self.assigned[node]


# ---- the machine: what it can hold, and a clean end on a signal ---------------------------------

def fleet_bounds(trace, initial: list[str]) -> tuple[int, int, int]:
    """(fewest, most) nodes up at once over the trace, and the trace ms where the most are."""
    from megatron_autohet.testing.trace import fleet_over_time

    sizes = [(0, len(initial))] + [(ms, len(up)) for ms, up in
                                   fleet_over_time([e for e in trace if e.ms > 0 or
                                                    e.node not in initial], initial)]
    peak_ms, peak = max(sizes, key=lambda s: s[1])
    return min(n for _, n in sizes), peak, peak_ms


def capacity_problem(peak: int, peak_ms: int, cpu_per_node: float, mem_per_node_gb: float,
                     cores: int, mem_available_gb: float | None) -> str | None:
    """One line when the trace's largest fleet does not fit this machine at the stated floors
    per node, else None."""
    if peak * cpu_per_node > cores:
        return (f"the trace has {peak} nodes up at once (at {peak_ms / 1000:g} s of the trace); "
                f"--cpu-per-node {cpu_per_node:g} allows at most "
                f"{math.floor(cores / cpu_per_node)} on this machine's {cores} cores")
    if mem_available_gb is not None and peak * mem_per_node_gb > mem_available_gb:
        return (f"the trace has {peak} nodes up at once (at {peak_ms / 1000:g} s of the trace); "
                f"--mem-per-node-gb {mem_per_node_gb:g} allows at most "
                f"{math.floor(mem_available_gb / mem_per_node_gb)} in this machine's "
                f"{mem_available_gb:.1f} GB available")
    return None


def mem_available_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


LIVE: list = []          # the fleets now running (replay), torn down by teardown()


class Interrupted(BaseException):
    """SIGTERM or SIGINT during the benchmark (a BaseException: no ``except Exception`` on
    the way out catches it; every ``with`` and ``finally`` runs)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def teardown() -> None:
    """Every fleet still running: its nodes' process trees and watchers killed, the
    rendezvous ended (EmulatedFleet.close; the emulated nodes are processes on loopback
    addresses: no namespaces, cgroups or veths to remove)."""
    for fleet in list(LIVE):
        with contextlib.suppress(Exception):
            fleet.close()
        with contextlib.suppress(ValueError):
            LIVE.remove(fleet)


@contextlib.contextmanager
def signals_raise():
    """SIGTERM and SIGINT raise :class:`Interrupted` in the main thread; a second one during
    the teardown is ignored (the teardown finishes)."""
    def handler(signum, frame):
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_all(modes, run_one, result: dict, out: str) -> int:
    """``run_one(mode)`` -> the run's row for each mode in turn, each row printed (by
    run_one) and written at once: ``result["runs"]`` gets it and the JSON file ``out`` is
    rewritten, so a bench stopped later keeps what it measured. SIGTERM / SIGINT: the fleet
    torn down (:func:`teardown`), ``result["interrupted"]`` set, the rows so far written;
    returns the exit status (0, or 128 + the signal)."""
    result.setdefault("runs", [])
    result["complete"] = False
    try:
        with signals_raise():
            try:
                for mode in modes:
                    result["runs"].append(run_one(mode))
                    write_json(result, out)
            except Interrupted as stop:
                teardown()
                result["interrupted"] = {"signal": str(stop), "time_unix": time.time(),
                                         "runs_done": [r["mode"] for r in result["runs"]]}
                write_json(result, out)
                print(f"bench_spot.py: {stop}: fleet torn down; {len(result['runs'])} run(s) "
                      f"kept in {out}", flush=True)
                return 128 + stop.signum
    finally:
        teardown()
    result["complete"] = True
    return 0


# ---- one run: replay the trace ----------------------------------------------------------------

class Agents:
    """The emulated nodes' agents while a run replays: an agent that exits while its node is
    still in the fleet and the job still runs is recorded (node, status, time) and started again
    after ``RESTART_DELAY_S``, as scripts/launch_node.sh does on a real node - never the end of
    the benchmark. Every wait of the replay goes through :meth:`wait`, which watches them."""

    def __init__(self, fleet, gpus: GpuTypes, finished):
        self.fleet = fleet
        self.gpus = gpus
        self.finished = finished
        self.up: list[str] = []
        self.exits: list[dict] = []
        self._down_since: dict[str, float] = {}

    def start(self, node: str) -> None:
        self.fleet.add(node, self.gpus.of(node))

    def follow(self, events) -> None:
        """The nodes a trace step adds are up from now on; the ones it removes are gone."""
        for e in events:
            if e.action == "add":
                self.up.append(e.node)
            else:
                self.up.remove(e.node)
                self.gpus.removed(e.node)

    def check(self) -> None:
        if self.finished():
            return
        for node in list(self.up):
            entry = self.fleet.nodes.get(node)
            code = entry.process.poll() if entry else None
            if code is not None and node not in self._down_since:
                self._down_since[node] = time.time()
                self.exits.append({"node": node, "status": code, "time_unix": time.time(),
                                   "log_tail": self.fleet.tail(node, lines=5)})
                print(f"  agent of {node} exited with {code}; starting it again in "
                      f"{RESTART_DELAY_S:g} s (as launch_node.sh would)", flush=True)
            if node in self._down_since and \
                    time.time() - self._down_since[node] >= RESTART_DELAY_S:
                del self._down_since[node]
                if node in self.fleet.nodes:
                    self.fleet.kill(node)      # its watcher too; the entry goes
                self.start(node)

    def wait(self, predicate, timeout: float) -> bool:
        """Until ``predicate()`` (True) or the timeout (False: the caller records it)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            self.check()
            time.sleep(0.1)
        return True

    def wait_all(self, timeout: float) -> dict[str, dict]:
        """Every agent's exit after the job: status and seconds after ``finished`` (None: still
        running at the timeout, then killed)."""
        done = self.finished()
        finished_at = done["time_unix"] if done else None
        out: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while self.fleet.nodes and time.monotonic() < deadline:
            for name, entry in list(self.fleet.nodes.items()):
                code = entry.process.poll()
                if code is not None:
                    out[name] = {"status": code, "after_finished_s": (
                        round(time.time() - finished_at, 2) if finished_at else None)}
                    entry.watcher.kill()       # SIGTERM would make it write a notice
                    entry.watcher.wait(timeout=10)
                    del self.fleet.nodes[name]
            time.sleep(0.1)
        for name in list(self.fleet.nodes):
            out[name] = {"status": None, "after_finished_s": None}
            self.fleet.kill(name)
        return out


def event_kind(event, mode: str, no_notice: bool) -> str:
    """What the replay does for one trace event: a join, a removal with notice or without (the
    trace's fourth column; without one a notice unless --no-notice), or - the baseline - a
    restart of everything."""
    if mode == "baseline":
        return "restart-all"
    if event.action == "add":
        return "join"
    return "kill" if no_notice or event.notice is False else "notice"


def joined_at(events: list[dict], t: float, joiners: list[str]) -> float | None:
    """When the nodes ``joiners`` (delivered at ``t``) were in the job: the first iteration after
    the first ``fleet`` event since ``t`` that lists them all (their first round done); None
    before that."""
    fleet = next((e for e in events if e["event"] == "fleet" and e["time_unix"] > t
                  and all(n in e.get("nodes", {}) for n in joiners)), None)
    if fleet is None:
        return None
    return next((e["time_unix"] for e in events if e["event"] == "first_iteration"
                 and e["time_unix"] > fleet["time_unix"]), None)


def idle_nodes(events: list[dict]) -> set[str]:
    """The nodes the plan in force (the newest ``plan`` event) leaves idle: every GPU of them
    (the newest ``fleet`` event's count, 1 where it says none) in the plan's ``idle`` list."""
    plan = next((e for e in reversed(events) if e["event"] == "plan"), None)
    fleet = next((e for e in reversed(events) if e["event"] == "fleet"), None)
    if plan is None:
        return set()
    idle: dict[str, int] = {}
    for entry in plan.get("idle", []):
        node = entry.rsplit(":", 1)[0]
        idle[node] = idle.get(node, 0) + 1
    gpus = {name: node.get("gpus", 1) for name, node in (fleet or {}).get("nodes", {}).items()}
    return {node for node, count in idle.items() if count >= gpus.get(node, 1)}


def stops_training(kinds: list[str], events, idle: set[str]) -> bool:
    """Whether a step stops the job's training: not when it only gives notice to nodes the plan
    leaves idle (nothing of theirs to save, no rank to re-plan: the job trains on, and no new
    first iteration follows). A kill of an idle node does stop it (the others confirm the loss
    and start a new round)."""
    return not all(k == "notice" and e.node in idle for e, k in zip(events, kinds))


def clock_restart(record: dict, events: list[dict]) -> float | None:
    """When the training clock runs again after the step ``record``: the joiners' first
    iteration for a step with joins (the clock was paused until they were in the job), else
    the job's first iteration after the step."""
    if record.get("joined_at") is not None:
        return record["joined_at"]
    return next((e["time_unix"] for e in events if e["event"] == "first_iteration"
                 and e["time_unix"] > record["t"]), None)


def hold_for_joiners(fleet, agents, record: dict, joiners: list[str], hold: Path,
                     trains_again) -> None:
    """The trace clock's pause for a step with joins: the job is held at the next iteration
    boundary (elastic/hold.py; the joiner's arrival - torchrun's SIGTERM - releases it) until
    the joiners are in the job, so neither the trace's clock nor the job advances while a
    joiner warms up (torch imports on this machine's shared cores: about a minute). A step
    that also removes nodes first waits for their round to train (a held job would not see
    a notice). Records in ``record``: ``held_iteration``, ``held_from`` (the job logged the held
    iteration; the analysis counts the held seconds from there to the stop that ended the
    hold), ``joined_at`` (None: not in the job after JOIN_TIMEOUT: the hold is lifted)."""
    from megatron_autohet.elastic.hold import hold_after

    t = record["t"]
    record.update(held_iteration=None, held_from=None, joined_at=None)
    if record["removes"]:
        agents.wait(trains_again, EVENT_TIMEOUT)
    if joined_at(fleet.events(), t, joiners) is None:
        held = fleet.iteration() + 1
        hold_after(hold, held)
        record["held_iteration"] = held

        def joined() -> bool:
            if record["held_from"] is None and fleet.iteration() >= held:
                record["held_from"] = time.time()
            return joined_at(fleet.events(), t, joiners) is not None
        agents.wait(joined, JOIN_TIMEOUT)
        hold_after(hold, None)
    record["joined_at"] = joined_at(fleet.events(), t, joiners)


def replay(mode: str, workdir: Path, trace_steps, initial: list[str], args,
           s3: tuple[str, str], *, make_fleet=None) -> dict:
    """Start the initial fleet, deliver the trace's steps (all events of one millisecond
    together; mode "autohet", "baseline" or NO_EVENTS with no steps), let the job finish; what
    happened when (the analysis reads the job's files afterwards). Nothing here ends the
    benchmark: an agent that exits is recorded and restarted, a job that does not train again
    within EVENT_TIMEOUT is recorded and the rest of the trace skipped. ``make_fleet``
    (the tests' fake) builds the fleet from EmulatedFleet's arguments."""
    from megatron_autohet.elastic.hold import HOLD_FILE_ENV

    endpoint, bucket = s3
    train_args = ["--plan", str(workdir.parent / "plan.yaml"), "--model", str(MODEL),
                  "--cluster", str(args.cluster), "--iters", str(args.iters),
                  "--save-interval", str(args.save_interval),
                  "--autohet-s3-uri", f"s3://{bucket}/{mode}",
                  "--autohet-s3-endpoint-url", endpoint]
    if make_fleet is None:
        from megatron_autohet.testing.emulate import EmulatedFleet as make_fleet
    workdir.mkdir(parents=True, exist_ok=True)
    hold = workdir / "hold"           # the join pause's hold file (hold_for_joiners)
    os.environ[HOLD_FILE_ENV] = str(hold)     # the nodes' environment: read at each start
    fleet = make_fleet(workdir, train_args=train_args, nnodes=args.nnodes, job_id=mode,
                       cold_workers=mode == "baseline", loss_timeout=args.loss_timeout)

    def finished() -> dict | None:
        return next((e for e in fleet.events("finished")), None)

    agents = Agents(fleet, GpuTypes(args.cluster), finished)
    delivered, skipped, problems = [], [], []
    rounds = 0

    def start_round() -> None:
        nonlocal rounds
        if mode == "baseline":          # a new job on exactly this fleet
            fleet.job_id, fleet.nnodes = f"baseline-{rounds}", f"{len(agents.up)}:{len(agents.up)}"
        rounds += 1
        for node in agents.up:
            agents.start(node)

    def training_since(t: float) -> bool:
        """The job logged a first iteration after t (it has restarted and trains again)."""
        return any(e["time_unix"] > t for e in fleet.events("first_iteration")) or \
            finished() is not None

    LIVE.append(fleet)
    try:
        with fleet:
            t_start = time.time()
            agents.up = list(initial)
            start_round()
            if not agents.wait(lambda: fleet.iteration() >= 1, START_TIMEOUT):
                raise SystemExit(f"{mode}: no first iteration after {START_TIMEOUT:.0f} s:\n"
                                 + "\n".join(fleet.tail(n) for n in fleet.nodes))
            t0 = time.time()
            metrics_at_t0 = len(fleet.metrics())
            print(f"  [{mode}] first iteration {t0 - t_start:.1f} s after the nodes started; "
                  "trace clock starts", flush=True)
            base, base_ms = t0, 0      # the training clock restarts when the job trains again
            for step in trace_steps:
                events = [e for e in step.events if not (e.ms == 0 and e.node in initial)]
                if not events:
                    continue
                stuck = None
                if delivered and finished() is None:   # not while still down for the last one
                    if not delivered[-1]["stops_training"]:
                        if args.clock == "training":     # the clock ran on through that step
                            base, base_ms = delivered[-1]["t"], delivered[-1]["ms"]
                    elif not agents.wait(lambda: training_since(delivered[-1]["t"]),
                                         EVENT_TIMEOUT):
                        stuck = f"not training again {EVENT_TIMEOUT:.0f} s after the previous step"
                    elif args.clock == "training":
                        base = clock_restart(delivered[-1], fleet.events()) or time.time()
                        base_ms = delivered[-1]["ms"]
                due = base + (step.ms - base_ms) / 1000.0 * args.time_scale
                agents.wait(lambda: time.time() >= due or finished() is not None, float("inf"))
                if stuck or finished() is not None:
                    if stuck and not problems:
                        problems.append({"ms": step.ms, "problem": stuck,
                                         "time_unix": time.time()})
                        print(f"  [{mode}] {stuck}: the rest of the trace is skipped", flush=True)
                    skipped += [{"ms": e.ms, "action": e.action, "node": e.node} for e in events]
                    continue
                t = time.time()
                before = fleet.iteration()
                kinds = [event_kind(e, mode, args.no_notice) for e in events]
                record = {"ms": step.ms, "t": t, "due": due, "late_s": round(t - due, 3),
                          "iteration_before": before, "kind": "+".join(sorted(set(kinds))),
                          "events": [{"action": e.action, "node": e.node, "kind": k}
                                     for e, k in zip(events, kinds)],
                          "removes": sum(e.action == "remove" for e in events),
                          "stops_training": mode == "baseline" or stops_training(
                              kinds, events, idle_nodes(fleet.events()))}
                if mode == "autohet":
                    leaving = [e.node for e, k in zip(events, kinds) if k == "notice"]
                    for node in leaving:          # every notice first: they come together
                        fleet.nodes[node].watcher.send_signal(signal.SIGTERM)
                    for e, k in zip(events, kinds):
                        if k == "kill":
                            fleet.kill(e.node)
                        elif k == "join":
                            agents.start(e.node)
                    agents.follow(events)
                    if "kill" in kinds:
                        record["iteration_before"] = fleet.iteration()
                    record["left_before_deadline"] = {node: fleet.reclaim_when_left(node)
                                                      for node in leaving}
                    joiners = [e.node for e, k in zip(events, kinds) if k == "join"]
                    if joiners:
                        hold_for_joiners(fleet, agents, record, joiners, hold,
                                         lambda: training_since(t))
                else:
                    for node in list(fleet.nodes):
                        fleet.kill(node)
                    record["iteration_before"] = fleet.iteration()     # nothing trains now
                    for node_dir in workdir.iterdir():                  # the local tier is gone
                        if (node_dir / "ckpt").is_dir():
                            shutil.rmtree(node_dir / "ckpt")
                    agents.follow(events)
                    start_round()
                delivered.append(record)
                what = ", ".join(f"{e['action']} {e['node']} ({e['kind']})"
                                 for e in record["events"])
                print(f"  [{mode}] {t - t0:6.1f} s: {what}, {record['late_s']:+.1f} s vs the "
                      f"trace, at iteration {before}"
                      + (f"; held after iteration {record['held_iteration']} until the joiners "
                         "were in" if record.get("held_iteration") else ""), flush=True)
            if not agents.wait(lambda: finished() is not None, EVENT_TIMEOUT) and not problems:
                problems.append({"ms": None, "problem": f"not finished {EVENT_TIMEOUT:.0f} s "
                                 "after the last step", "time_unix": time.time()})
            agent_ends = agents.wait_all(timeout=EXIT_TIMEOUT)
    finally:
        LIVE.remove(fleet)
        os.environ.pop(HOLD_FILE_ENV, None)
    late_exits = {n: a for n, a in agent_ends.items() if a["status"] != 0}
    if late_exits:
        print(f"  [{mode}] agents that did not end with status 0 after the job: {late_exits}",
              flush=True)
    return {"t_start": t_start, "t0": t0, "metrics_at_t0": metrics_at_t0, "delivered": delivered,
            "skipped": skipped, "problems": problems, "rounds_started": rounds,
            "agent_exits_during_run": agents.exits, "agent_ends": agent_ends,
            "finished": finished(), "nnodes": args.nnodes, "loss_timeout_s": args.loss_timeout}


# ---- analysis ---------------------------------------------------------------------------------

def _record_time(rec: dict) -> float:
    return time.mktime(time.strptime(rec["timestamp"], "%Y-%m-%d %H:%M:%S"))


def _step_row(d: dict, events: list[dict], records: list[dict], median_s: float) -> dict:
    """One delivered step's figures; what the job's files do not show is None (a plan written
    by nobody, a job that never trained again), never an exception. A step that did not stop
    training costs nothing when it only took nodes the plan left idle; a join that no later plan
    includes was not admitted (no downtime to report: None)."""
    t = d["t"]
    joins = [e["node"] for e in d["events"] if e["action"] == "add"]
    later_plans = [e for e in events if e["event"] == "plan" and e["time_unix"] > t]
    admitted = (all(any(node in p["nodes"] for p in later_plans) for node in joins)
                if joins else None)
    if d.get("stops_training") is False or (
            not any(e["event"] in ("stop", "plan", "first_iteration") and e["time_unix"] > t
                    for e in events) and any(e["event"] == "finished" for e in events)):
        return {"trace_s": d["ms"] / 1000.0, "kind": d["kind"], "events": d["events"],
                "removes": sum(e["action"] == "remove" for e in d["events"]),
                "late_s": d["late_s"], "resumed": True, "interrupted": False,
                "admitted": admitted, "downtime_s": None if joins else 0.0,
                **{key: None for key in ("detect_s", "save_s", "evacuate_s", "evacuated_bytes",
                                         "replan_s", "plan_decision", "plan_nodes", "recover_s",
                                         "restart_s", "setup_s", "first_iteration_s")},
                "recover_phases_s": {}, "recover_bytes": {}, "rounds": 0,
                "iteration_stopped": d["iteration_before"],
                "iteration_recovered": d["iteration_before"], "iterations_lost": 0,
                "lost_s": 0.0, "cost_s": None if joins else 0.0, "held_s": 0.0}
    resume = next((e for e in events if e["event"] == "first_iteration" and e["time_unix"] > t),
                  None)
    window = (t, resume["time_unix"] if resume else float("inf"))

    def last(kind):
        found = [e for e in events
                 if e["event"] == kind and window[0] < e["time_unix"] <= window[1]]
        return found[-1] if found else None

    def first(kind):
        return next((e for e in events
                     if e["event"] == kind and window[0] < e["time_unix"] <= window[1]), None)

    stop, evac, plan, recovery = first("stop"), first("evacuate"), last("plan"), last("recovery")
    # The join pause (hold_for_joiners): from the held iteration's end to the stop the joiner's
    # arrival made there - the job idle while the emulated joiner warmed up, off every clock.
    held = (stop["time_unix"] - d["held_from"]
            if d.get("held_from") is not None and stop is not None
            and stop["iteration"] == d.get("held_iteration") else 0.0)
    row = {"trace_s": d["ms"] / 1000.0, "kind": d["kind"], "events": d["events"],
           "removes": sum(e["action"] == "remove" for e in d["events"]),
           "late_s": d["late_s"], "interrupted": True,
           # the job trained again, or had trained its last iteration (a stop right at the end)
           "resumed": resume is not None or any(e["event"] == "finished" and e["time_unix"] > t
                                                for e in events),
           "admitted": admitted,
           "detect_s": stop["time_unix"] - t if stop else None,
           "save_s": (evac["time_unix"] - stop["time_unix"]) if evac and stop else None,
           "evacuate_s": evac["seconds"] if evac else None,
           "evacuated_bytes": evac["bytes"] if evac else None,
           "replan_s": plan["seconds"] if plan else None,
           "plan_decision": plan["decision"] if plan else None,
           "plan_nodes": plan["nodes"] if plan else None,
           "recover_phases_s": recovery["seconds"] if recovery else {},
           "recover_bytes": recovery["bytes"] if recovery else {},
           "rounds": sum(e["event"] == "plan" and window[0] < e["time_unix"] <= window[1]
                         for e in events),
           "held_s": max(0.0, held)}
    recover_s = sum(recovery["seconds"].values()) if recovery else None
    row["recover_s"] = recover_s
    down_from = stop["time_unix"] if stop else t
    old_end = evac["time_unix"] if evac else down_from
    plan_start = plan["time_unix"] - plan["seconds"] if plan else None
    row["restart_s"] = plan_start - old_end if plan else None
    # The first iteration after the restart: its record has the event's iteration and a
    # timestamp (1 s resolution) at most a second or two from the event.
    candidates = [r for r in records if resume and r["iteration"] == resume["iteration"]]
    first_record = min(candidates, key=lambda r: abs(_record_time(r) - resume["time_unix"]),
                       default=None)
    if first_record is not None:
        first_s = first_record["elapsed_ms"] / 1000.0
        first_start = resume["time_unix"] - first_s
        row["first_iteration_s"] = first_s
        row["downtime_s"] = first_start - down_from
        row["setup_s"] = (first_start - (recover_s or 0.0) - plan["time_unix"]) if plan else None
    else:
        row.update(first_iteration_s=None, downtime_s=None, setup_s=None)
    trained = stop["iteration"] if stop else d["iteration_before"]
    recovered = recovery["iteration"] if recovery else (
        resume["iteration"] - 1 if resume else None)
    row["iteration_stopped"], row["iteration_recovered"] = trained, recovered
    row["iterations_lost"] = trained - recovered if recovered is not None else None
    row["lost_s"] = row["iterations_lost"] * median_s if recovered is not None else None
    row["cost_s"] = (row["downtime_s"] + row["lost_s"]
                     if row["downtime_s"] is not None and row["lost_s"] is not None else None)
    return row


def analyse(mode: str, workdir: Path, run: dict) -> dict:
    from megatron_autohet.testing.emulate import read_jsonl

    events = read_jsonl(workdir / "events.jsonl")
    records = read_jsonl(workdir / "metrics.jsonl")
    median_s = statistics.median(r["elapsed_ms"] for r in records) / 1000.0
    per_event = [_step_row(d, events, records, median_s) for d in run["delivered"]]
    finished = run["finished"]
    end = finished["time_unix"] if finished else max(
        [e["time_unix"] for e in events] or [run["t0"]])
    after_t0 = records[run["metrics_at_t0"]:]
    superseded = set()
    seen: set[int] = set()
    for i in range(len(records) - 1, -1, -1):           # a record re-trained later is wasted
        if records[i]["iteration"] in seen:
            superseded.add(i)
        seen.add(records[i]["iteration"])
    busy = sum(r["elapsed_ms"] for r in after_t0) / 1000.0
    kept = [r for i, r in enumerate(records) if i >= run["metrics_at_t0"] and i not in superseded]
    useful = sum(r["elapsed_ms"] for r in kept) / 1000.0
    held = sum(r["held_s"] for r in per_event)
    wall = end - run["t0"] - held             # the join pauses are off the clock
    return {
        "events": per_event, "by_kind": by_kind(per_event),
        "skipped_events": run["skipped"], "problems": run["problems"],
        "agent_exits_during_run": run["agent_exits_during_run"],
        "agent_ends": run["agent_ends"],
        "median_iteration_s": median_s,
        "finished": finished is not None,
        "final_iteration": finished["iteration"] if finished else (
            records[-1]["iteration"] if records else 0),
        "iterations_logged": len(records), "iterations_retrained": len(superseded),
        "wall_s_first_iteration_to_finished": wall,
        "held_s": held,
        "wall_s_nodes_started_to_finished": end - run["t_start"],
        "busy_fraction": busy / wall, "useful_fraction": useful / wall,
        # 1.0 is a job that never stops, re-trains nor saves at its typical speed
        "kept_at_median_fraction": len(kept) * median_s / wall,
        "rate_iterations_per_s": len(kept) / wall,
        "goodput": None,            # goodput(): once the no-event run has run
        "rounds_started_by_benchmark": run["rounds_started"],
        "plan_events": sum(e["event"] == "plan" for e in events),
        "workdir": str(workdir),
        "nnodes": run.get("nnodes"), "loss_timeout_s": run.get("loss_timeout_s"),
    }


def goodput(run: dict, reference: dict | None) -> float | None:
    """The run's rate over the no-event run's (None without one)."""
    return (run["rate_iterations_per_s"] / reference["rate_iterations_per_s"]
            if reference else None)


def by_kind(rows: list[dict]) -> dict[str, dict]:
    """Per kind of step (notice, kill, join, restart-all, or several at once: "join+notice"):
    how many, downtime mean and max, iterations lost in all and at most, and how many never
    trained again."""
    out = {}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        down = [r["downtime_s"] for r in mine if r["downtime_s"] is not None]
        lost = [r["iterations_lost"] for r in mine if r["iterations_lost"] is not None]
        out[kind] = {"steps": len(mine), "events": sum(len(r["events"]) for r in mine),
                     "downtime_mean_s": mean(down), "downtime_max_s": max(down, default=None),
                     "iterations_lost_total": sum(lost),
                     "iterations_lost_max": max(lost, default=None),
                     "never_resumed": sum(not r["resumed"] for r in mine),
                     "joins_not_admitted": sum(r["admitted"] is False for r in mine)}
    return out


# ---- report -------------------------------------------------------------------------------------

COLUMNS = [("trace s", "trace_s", 7), ("events", None, 26), ("late", "late_s", 5),
           ("detect", "detect_s", 6), ("save", "save_s", 5), ("restart", "restart_s", 7),
           ("re-plan", "replan_s", 7), ("setup", "setup_s", 6), ("recover", "recover_s", 7),
           ("1st it", "first_iteration_s", 6), ("down", "downtime_s", 6),
           ("lost it", "iterations_lost", 7), ("lost s", "lost_s", 6), ("cost", "cost_s", 6),
           ("S3 MB", None, 6)]
SHORT = {"notice": "n", "kill": "k", "join": "j", "restart-all": "r"}


def print_run(name: str, r: dict) -> None:
    print(f"\n{name}: median iteration {r['median_iteration_s']:.2f} s, "
          f"{r['iterations_logged']} iterations logged for {r['final_iteration']} "
          f"({r['iterations_retrained']} re-trained), {r['wall_s_first_iteration_to_finished']:.0f}"
          f" s from the first iteration to the end{'' if r['finished'] else ' (NOT FINISHED)'}: "
          f"{100 * r['busy_fraction']:.0f}% in iterations, {100 * r['useful_fraction']:.0f}% in "
          f"iterations kept; kept x median iteration {100 * r['kept_at_median_fraction']:.0f}%; "
          f"rate {r['rate_iterations_per_s']:.2f} it/s"
          + ("" if r["goodput"] is None else
             f"; goodput {100 * r['goodput']:.0f}% of the no-event run's rate")
          + (f"; not replayed: {len(r['skipped_events'])} events" if r["skipped_events"] else ""))
    for problem in r["problems"]:
        print(f"  problem: {problem['problem']}")
    for exit_ in r["agent_exits_during_run"]:
        print(f"  agent of {exit_['node']} exited with {exit_['status']} while the job ran "
              "(started again)")
    ends = r["agent_ends"]
    after = [a["after_finished_s"] for a in ends.values() if a["after_finished_s"] is not None]
    if ends:
        print(f"  agents after the job: {len(ends)}, ended "
              + (f"{min(after):.1f}-{max(after):.1f} s after it finished" if after else "-")
              + "".join(f"; {n} with status {a['status']}" for n, a in sorted(ends.items())
                        if a["status"] != 0))
    if not r["events"]:
        return
    print("  events: n = notice, k = kill (no notice), j = join, r = restart everything")
    print("| " + " | ".join(f"{h:>{w}}" for h, _, w in COLUMNS) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for _, _, w in COLUMNS) + "|")
    for e in r["events"]:
        cells = []
        for head, key, width in COLUMNS:
            if head == "events":
                value = " ".join(f"{'+' if x['action'] == 'add' else '-'}{x['node']}"
                                 f"/{SHORT[x['kind']]}" for x in e["events"])
            elif head == "S3 MB":
                value = f"{e['recover_bytes'].get('s3', 0) / 1e6:.1f}"
            elif e[key] is None:
                value = "-"
            elif key == "iterations_lost":
                value = str(e[key])
            else:
                value = f"{e[key]:.1f}" if key in ("trace_s", "late_s") else f"{e[key]:.2f}"
            cells.append(f"{value:>{width}}")
        print("| " + " | ".join(cells) + " |")
    f = lambda v: "-" if v is None else f"{v:.1f}"                        # noqa: E731
    print("| kind | steps | events | downtime mean s | downtime max s | iterations lost | "
          "most lost in a step | never trained again | joins not admitted |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, k in r["by_kind"].items():
        print(f"| {kind} | {k['steps']} | {k['events']} | {f(k['downtime_mean_s'])} | "
              f"{f(k['downtime_max_s'])} | {k['iterations_lost_total']} | "
              f"{'-' if k['iterations_lost_max'] is None else k['iterations_lost_max']} | "
              f"{k['never_resumed']} | {k['joins_not_admitted']} |")


def mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def summarise(autohet: dict, baseline: dict, reference: dict | None,
              save_interval: int) -> dict:
    def removes(run, key):
        return [e[key] for e in run["events"] if e["removes"] and e[key] is not None]
    a_down, b_down = (mean(removes(r, "downtime_s")) for r in (autohet, baseline))
    a_cost, b_cost = (mean(removes(r, "cost_s")) for r in (autohet, baseline))
    a_rec, b_rec = (mean(removes(r, "recover_s")) for r in (autohet, baseline))
    lost_notice = [e["iterations_lost"] for e in autohet["events"] if e["kind"] == "notice"]
    killed = [e for e in autohet["events"] if "kill" in e["kind"].split("+")]
    lost_kill = [e["iterations_lost"] for e in killed]
    return {
        "no_event_rate_iterations_per_s": reference["rate_iterations_per_s"] if reference
        else None,
        "autohet_rate_iterations_per_s": autohet["rate_iterations_per_s"],
        "baseline_rate_iterations_per_s": baseline["rate_iterations_per_s"],
        "autohet_goodput": autohet["goodput"], "baseline_goodput": baseline["goodput"],
        "autohet_kept_at_median_fraction": autohet["kept_at_median_fraction"],
        "baseline_kept_at_median_fraction": baseline["kept_at_median_fraction"],
        "autohet_mean_recover_per_removal_step_s": a_rec,
        "baseline_mean_recover_per_removal_step_s": b_rec,
        "recover_ratio_baseline_over_autohet": b_rec / a_rec if a_rec and b_rec else None,
        "removal_steps": sum(1 for e in autohet["events"] if e["removes"]),
        "autohet_mean_downtime_per_removal_step_s": a_down,
        "baseline_mean_downtime_per_removal_step_s": b_down,
        "downtime_ratio_baseline_over_autohet": b_down / a_down if a_down and b_down else None,
        "autohet_mean_cost_per_removal_step_s": a_cost,
        "baseline_mean_cost_per_removal_step_s": b_cost,
        "cost_ratio_baseline_over_autohet": b_cost / a_cost if a_cost and b_cost else None,
        "iterations_lost_with_notice": lost_notice,
        "zero_lost_with_notice": all(n == 0 for n in lost_notice),
        # a step with a removal without notice: its downtime, and at most a save interval lost
        "downtime_without_notice_s": [e["downtime_s"] for e in killed],
        "iterations_lost_without_notice": lost_kill,
        "save_interval": save_interval,
        "lost_without_notice_within_save_interval": all(
            n is not None and n <= save_interval for n in lost_kill),
    }


def print_summary(s: dict) -> None:
    f = lambda v: "n/a" if v is None else f"{v:.2f}"                      # noqa: E731
    pct = lambda v: "n/a" if v is None else f"{100 * v:.0f}%"             # noqa: E731
    print(f"\ngoodput (rate over the no-event run's {f(s['no_event_rate_iterations_per_s'])} "
          f"it/s): autohet {pct(s['autohet_goodput'])} ({f(s['autohet_rate_iterations_per_s'])} "
          f"it/s), baseline {pct(s['baseline_goodput'])} "
          f"({f(s['baseline_rate_iterations_per_s'])} it/s); kept x median iteration: autohet "
          f"{pct(s['autohet_kept_at_median_fraction'])}, baseline "
          f"{pct(s['baseline_kept_at_median_fraction'])}. Steps with removals: "
          f"{s['removal_steps']}; mean "
          f"downtime per such step: autohet {f(s['autohet_mean_downtime_per_removal_step_s'])} s,"
          f" baseline {f(s['baseline_mean_downtime_per_removal_step_s'])} s: baseline/autohet = "
          f"{f(s['downtime_ratio_baseline_over_autohet'])}; with the re-trained iterations "
          f"(cost): {f(s['autohet_mean_cost_per_removal_step_s'])} s vs "
          f"{f(s['baseline_mean_cost_per_removal_step_s'])} s = "
          f"{f(s['cost_ratio_baseline_over_autohet'])}x; the recover phase alone: "
          f"{f(s['autohet_mean_recover_per_removal_step_s'])} s vs "
          f"{f(s['baseline_mean_recover_per_removal_step_s'])} s = "
          f"{f(s['recover_ratio_baseline_over_autohet'])}x; iterations lost with notice: "
          f"{s['iterations_lost_with_notice']}; without notice: "
          f"{s['iterations_lost_without_notice']} (save interval {s['save_interval']}), downtime "
          + (", ".join(f(v) for v in s["downtime_without_notice_s"]) or "-") + " s")


# ---- main ---------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=None,
                        help=f"the trace (default {CHURN_TRACE.relative_to(ROOT)}; --quick "
                             f"{QUICK_TRACE.relative_to(ROOT)})")
    parser.add_argument("--cluster", default=str(CLUSTER), metavar="C.yaml",
                        help=f"the cluster file of the job's nodes (default "
                             f"{CLUSTER.relative_to(ROOT)}; for "
                             "the whole-zone trace "
                             "configs/traces/zone-loss-4node.csv, "
                             "configs/clusters/spot-4-zones.yaml)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="seconds per trace second (default 0.02: the churn trace's 4.7 "
                             "hours in about 6 minutes of training; --quick 0.5)")
    parser.add_argument("--iters", type=int, default=None,
                        help="iterations of each job (default 3000; --quick 400): enough that "
                             "the job is still training when the last event comes (events "
                             "after the job's end are listed as not replayed): about the "
                             "trace's training clock (printed at the start) over the iteration "
                             "time (0.1-0.15 s here), plus a margin; joins hold the job, so "
                             "they add none (before the hold, the churn trace's 6 minutes of "
                             "training clock took 2800 iterations at load 8-23)")
    parser.add_argument("--save-interval", type=int, default=10,
                        help="periodic checkpoints (disk + S3) every N iterations (default 10)")
    parser.add_argument("--clock", choices=("training", "wall"), default="training",
                        help="training (default): the trace's clock stops while the job is down, "
                             "so each event comes after the trace's gap of training; wall: "
                             "events at their compressed trace times (one due while the job is "
                             "down waits until it trains again: 'late')")
    parser.add_argument("--no-notice", action="store_true",
                        help="autohet run: every removal is a SIGKILL (default: the trace's "
                             "fourth column, a notice where it says nothing)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the run without events (as long as the others' training: "
                             "minutes on the churn trace); no goodput is printed then. Not with "
                             "--quick, whose no-event run takes about a minute")
    parser.add_argument("--quick", action="store_true",
                        help="a short replay: the 4-node synthetic trace (3 events), trace clock "
                             "x0.5, 400 iterations (a joining node is announced once its "
                             "warm fork server has loaded torch: about a minute on 2 loaded "
                             "cores, and 150 iterations were over by then): the three runs took 5 "
                             "minutes at load 2-7 on 2 cores, longer under more load")
    parser.add_argument("--loss-timeout", type=float, default=DEFAULT_LOSS_TIMEOUT_S,
                        metavar="S",
                        help="every `autohet node --loss-timeout`: a node lost without notice is "
                             "found after S seconds (default: the product's, "
                             f"{DEFAULT_LOSS_TIMEOUT_S:g}; the tests use 5); recorded in each "
                             "run's row")
    parser.add_argument("--cpu-per-node", type=float, default=CPU_PER_NODE, metavar="CORES",
                        help="the least CPU one emulated node may get (default "
                             f"{CPU_PER_NODE:g}): a trace with more nodes up at once than the "
                             "cores allow at that is refused in one line")
    parser.add_argument("--mem-per-node-gb", type=float, default=MEM_PER_NODE_GB, metavar="GB",
                        help=f"memory one emulated node takes (default {MEM_PER_NODE_GB:g}): a "
                             "trace with more nodes up at once than the available memory "
                             "holds at that is refused in one line")
    parser.add_argument("--workdir", default=None,
                        help="keep the runs' files here (default: a temporary directory)")
    parser.add_argument("--out", default=str(ROOT / "bench-out" / "bench-spot.json"),
                        help="JSON results path (default bench-out/bench-spot.json), rewritten "
                             "after each run with the rows so far")
    args = parser.parse_args()
    if args.no_reference and args.quick:
        parser.exit(2, "bench_spot.py: --no-reference: not with --quick (its no-event run takes "
                       "about a minute and is what its goodput is measured against)\n")
    args.trace = args.trace or str(QUICK_TRACE if args.quick else CHURN_TRACE)
    args.time_scale = args.time_scale or (0.5 if args.quick else 0.02)
    args.iters = args.iters or (400 if args.quick else 3000)
    try:
        check_loss_timeout(args.loss_timeout)
    except ConfigError as err:
        parser.exit(2, f"bench_spot.py: {err}\n")

    silence_known_megatron_warnings()
    from megatron_autohet.testing.trace import load_trace, steps
    from megatron_autohet.testing.s3_server import moto_s3_server

    trace = load_trace(args.trace)
    initial = [e.node for e in trace if e.ms == 0 and e.action == "add"]
    fewest, peak, peak_ms = fleet_bounds(trace, initial)
    problem = capacity_problem(peak, peak_ms, args.cpu_per_node, args.mem_per_node_gb,
                               os.cpu_count() or 1, mem_available_gb())
    if problem:
        parser.exit(2, f"bench_spot.py: {problem}\n")
    # torchrun's --nnodes MIN:MAX: at most the trace's largest fleet, at least 2 (or 1 where the
    # trace goes down to one node)
    args.nnodes = f"{max(1, min(2, fewest))}:{peak}"
    trace_steps = steps(trace)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-spot-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    clock_s = max((e.ms for e in trace), default=0) / 1000.0 * args.time_scale
    print(f"trace {args.trace}: {len(trace) - len(initial)} events in "
          f"{sum(1 for s in trace_steps if s.ms > 0)} steps after the initial fleet "
          f"{', '.join(initial)}, {fewest}-{peak} nodes up (--nnodes {args.nnodes}); time scale "
          f"{args.time_scale:g} ({args.clock} clock: {clock_s:.0f} s to the last step); "
          f"{args.iters} iterations, saves every {args.save_interval}; removals are "
          f"{'SIGKILLs' if args.no_notice else 'as the trace says (notice where it does not)'}"
          f"; --loss-timeout {args.loss_timeout:g}; workdir {workdir}", flush=True)
    result = {
        "command": {k: v for k, v in vars(args).items()},
        "trace": [{"ms": e.ms, "action": e.action, "node": e.node, "notice": e.notice}
                  for e in trace],
        "setting": {"model": str(MODEL.relative_to(ROOT)),
                    "cluster": os.path.relpath(Path(args.cluster).resolve(), ROOT),
                    "global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH,
                    "workers": "CPU (gloo), one per emulated node, OMP_NUM_THREADS=1",
                    "nnodes": args.nnodes, "loss_timeout_s": args.loss_timeout,
                    "s3": "moto server in the benchmark's process (loopback)",
                    "baseline": "on every membership change: SIGKILL of every node's process "
                                "tree (no emergency save), node-local checkpoint directories "
                                "deleted, job restarted at once on the new fleet (new "
                                "rendezvous id, --nnodes N:N, cold workers); recovery from S3 "
                                "only",
                    "cpu_count": os.cpu_count(), "machine": platform.platform(),
                    "python": platform.python_version(),
                    "load_average_1min": {"before": load_before[0]}},
        "runs": [],
    }
    modes = ("autohet", "baseline") if args.no_reference else (NO_EVENTS, "autohet", "baseline")
    analysed: dict[str, dict] = {}
    names = {NO_EVENTS: "no events (the initial fleet throughout: the reference)",
             "autohet": "autohet (local checkpoints + peers + S3)",
             "baseline": "baseline (restart everything from S3: SIGKILL all, local tier wiped, "
                         "restart)"}

    def run_one(mode: str) -> dict:
        started = time.time()
        print(f"[{mode}] replaying", flush=True)
        run = replay(mode, workdir / mode, [] if mode == NO_EVENTS else trace_steps, initial,
                     args, s3)
        row = analysed[mode] = analyse(mode, workdir / mode, run)
        row["goodput"] = goodput(row, analysed.get(NO_EVENTS))
        print(f"[{mode}] done in {time.time() - started:.0f} s", flush=True)
        print_run(names[mode], row)
        return {"mode": mode, "loss_timeout_s": args.loss_timeout,
                "load_average_1min_after": os.getloadavg()[0], **row, "replay": run}

    with signals_raise():         # until run_all's own handlers: the set-up is torn down too
        autohet("plan", "--cluster", args.cluster, "--model", MODEL, "--global-batch-size",
                GLOBAL_BATCH, "--micro-batch-size", MICRO_BATCH, "-o", workdir / "plan.yaml")
        warm_data_cache(args.iters)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    with moto_s3_server("bench-spot") as s3:
        status = run_all(modes, run_one, result, args.out)
    if status:
        sys.exit(status)
    reference = analysed.get(NO_EVENTS)
    summary = summarise(analysed["autohet"], analysed["baseline"], reference,
                        args.save_interval)
    print_summary(summary)
    result["setting"]["load_average_1min"]["after"] = os.getloadavg()[0]
    result.update({"autohet": analysed["autohet"], "baseline": analysed["baseline"],
                   "no_events": reference, "summary": summary})
    write_json(result, args.out)


if __name__ == "__main__":
    main()
