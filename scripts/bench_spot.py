#!/usr/bin/env python
"""Benchmark an elastic job on an emulated spot fleet replaying a preemption trace, against a
restart-everything-from-S3 baseline on the same trace in the same run.

Both runs train the tiny GPT (configs/models/tiny.yaml) on the nodes of
configs/clusters/spot-4.yaml, each node a real `autohet node` (torchrun agent, CPU workers) +
`autohet watch` on this machine (megatron_autohet/elastic/emulate.py), with checkpoints every
``--save-interval`` iterations to the nodes' disks and to S3 (moto's server, started here, in
this process). The trace (``ms,add|remove,node``; events at 0 ms are the starting fleet) is
replayed with its clock compressed: the gap between two events, ``ms`` apart, becomes ``ms / 1000 * --time-scale`` seconds
of *training* (``--clock training``, the default): the clock starts at the job's first iteration
and stops from an event until the job's first iteration after it, so every event comes after the
same training time in both runs whatever their downtimes, and where it falls relative to the
periodic saves does not depend on how long the previous restart took. ``--clock wall`` delivers
each event at ``ms / 1000 * --time-scale`` after the first iteration instead; one due while the
job is still down waits until it trains again, and the delay is reported (``late``).

* **autohet**: ``remove`` = a preemption *with notice* (``EmulatedFleet.preempt``: SIGTERM to the
  node's watcher; the job saves the iteration in flight, moves the node's files to the others,
  the node leaves, the survivors re-plan and recover from disks/peers/S3); with ``--no-notice``
  the node is killed instead (SIGKILL of its process tree). ``add`` = a node joins (torchrun
  stops the workers with SIGTERM, they save, the job re-plans with the new node).
* **baseline** (restart everything from S3, Varuna-style checkpoint/restart): the same product
  code, but on every membership change (remove *or* add) every node's process tree is killed
  with SIGKILL (a job without notice handling: no emergency save), every node-local checkpoint
  directory is deleted, and the job is started again on the new fleet (a new rendezvous id,
  ``--nnodes N:N`` so it starts with exactly that fleet). Recovery then reads everything from S3:
  the newest step whose upload had completed; the iterations after it are lost and re-trained.
  The restart is immediate (the benchmark is an omniscient job manager: no detection delay).

Per event, from the events (``WORKDIR/<run>/events.jsonl``, ``time_unix``) and the iteration log
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
* ``lost``: iterations trained before the event and not in the checkpoint recovered (re-trained),
  and their cost (``lost s``: lost x the run's median iteration time); ``cost`` = down + lost s.

Per run: wall time from the first iteration to the ``finished`` event, the fraction of it spent in
iterations (``busy``) and in iterations that were not re-trained (``useful``).

    python scripts/bench_spot.py [--quick] [--trace configs/traces/synthetic-4node.csv]
        [--time-scale 1.0] [--iters 300] [--clock training|wall] [--save-interval 10]
        [--no-notice] [--workdir DIR] [--out bench-out/bench-spot.json]

CPU only; every process shares this machine's cores, so start-up (torch imports) weighs far
more than on a real fleet; the JSON records the core count and load average.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import silence_known_megatron_warnings, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))           # the moto S3 server of the tests

MODEL = ROOT / "configs/models/tiny.yaml"
CLUSTER = ROOT / "configs/clusters/spot-4.yaml"
GLOBAL_BATCH, MICRO_BATCH = 8, 1
START_TIMEOUT, EVENT_TIMEOUT = 600.0, 600.0      # safety nets, not measurements


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


# ---- one run: replay the trace ----------------------------------------------------------------

def replay(mode: str, workdir: Path, trace, initial: list[str], args, s3: tuple[str, str]) -> dict:
    """Start the initial fleet, deliver the trace's events (mode "autohet" or "baseline"), let
    the job finish; what happened when (the analysis reads the job's files afterwards)."""
    from megatron_autohet.elastic.emulate import EmulatedFleet

    endpoint, bucket = s3
    gpus = GpuTypes(CLUSTER)
    train_args = ["--plan", str(workdir.parent / "plan.yaml"), "--model", str(MODEL),
                  "--cluster", str(CLUSTER), "--iters", str(args.iters),
                  "--save-interval", str(args.save_interval),
                  "--autohet-s3-uri", f"s3://{bucket}/{mode}",
                  "--autohet-s3-endpoint-url", endpoint]
    fleet = EmulatedFleet(workdir, train_args=train_args, nnodes="2:8", job_id=mode)
    up = list(initial)
    delivered, skipped = [], []
    rounds = 0

    def start_round() -> None:
        nonlocal rounds
        if mode == "baseline":          # a new job on exactly this fleet
            fleet.job_id, fleet.nnodes = f"baseline-{rounds}", f"{len(up)}:{len(up)}"
        rounds += 1
        for node in up:
            fleet.add(node, gpus.of(node))

    def finished() -> bool:
        return bool(fleet.events("finished"))

    def training_since(t: float) -> bool:
        """The job logged a first iteration after t (it has restarted and trains again)."""
        return any(e["time_unix"] > t for e in fleet.events("first_iteration")) or finished()

    with fleet:
        t_start = time.time()
        start_round()
        fleet.wait_for(lambda: fleet.iteration() >= 1, timeout=START_TIMEOUT,
                       what=f"{mode}: first iteration")
        t0 = time.time()
        metrics_at_t0 = len(fleet.metrics())
        print(f"  [{mode}] first iteration {t0 - t_start:.1f} s after the nodes started; "
              "trace clock starts", flush=True)
        base, base_ms = t0, 0          # the training clock restarts when the job trains again
        for ev in trace:
            if ev.ms == 0 and ev.node in initial:
                continue
            if args.clock == "training" and delivered and not finished():
                fleet.wait_for(lambda: training_since(delivered[-1]["t"]),
                               timeout=EVENT_TIMEOUT, what=f"{mode}: training again")
                base = next((e["time_unix"] for e in fleet.events("first_iteration")
                             if e["time_unix"] > delivered[-1]["t"]), time.time())
                base_ms = delivered[-1]["ms"]
            due = base + (ev.ms - base_ms) / 1000.0 * args.time_scale
            while time.time() < due and not finished():
                time.sleep(0.1)
            if delivered:      # not while the job is still restarting for the previous event
                fleet.wait_for(lambda: training_since(delivered[-1]["t"]),
                               timeout=EVENT_TIMEOUT, what=f"{mode}: training again")
            if finished():
                skipped.append({"ms": ev.ms, "action": ev.action, "node": ev.node})
                continue
            t = time.time()
            before = fleet.iteration()
            record = {"ms": ev.ms, "action": ev.action, "node": ev.node, "t": t, "due": due,
                      "late_s": round(t - due, 3), "iteration_before": before}
            if mode == "autohet":
                if ev.action == "add":
                    kind = "join"
                    fleet.add(ev.node, gpus.of(ev.node))
                    up.append(ev.node)
                elif args.no_notice:
                    kind = "kill"
                    fleet.kill(ev.node)
                    record["iteration_before"] = fleet.iteration()
                    up.remove(ev.node)
                else:
                    kind = "notice"
                    record["left_before_deadline"] = fleet.preempt(ev.node)
                    up.remove(ev.node)
            else:
                kind = "restart-all"
                for node in list(fleet.nodes):
                    fleet.kill(node)
                record["iteration_before"] = fleet.iteration()     # nothing trains now
                for node_dir in workdir.iterdir():                  # the local tier is gone
                    if (node_dir / "ckpt").is_dir():
                        shutil.rmtree(node_dir / "ckpt")
                if ev.action == "add":
                    up.append(ev.node)
                else:
                    up.remove(ev.node)
                    gpus.removed(ev.node)
                start_round()
            if ev.action == "remove" and mode == "autohet":
                gpus.removed(ev.node)
            record["kind"] = kind
            delivered.append(record)
            print(f"  [{mode}] {t - t0:6.1f} s: {ev.action} {ev.node} ({kind}, "
                  f"{record['late_s']:+.1f} s vs the trace) at iteration {before}", flush=True)
        codes = fleet.wait_all(timeout=EVENT_TIMEOUT)
    if any(codes.values()):
        raise SystemExit(f"{mode}: nodes exited with {codes}")
    return {"t_start": t_start, "t0": t0, "metrics_at_t0": metrics_at_t0, "delivered": delivered,
            "skipped": skipped, "rounds_started": rounds, "exit_codes": codes}


# ---- analysis ---------------------------------------------------------------------------------

def _record_time(rec: dict) -> float:
    return time.mktime(time.strptime(rec["timestamp"], "%Y-%m-%d %H:%M:%S"))


def analyse(mode: str, workdir: Path, run: dict) -> dict:
    from megatron_autohet.elastic.emulate import read_jsonl

    events = read_jsonl(workdir / "events.jsonl")
    records = read_jsonl(workdir / "metrics.jsonl")
    median_s = statistics.median(r["elapsed_ms"] for r in records) / 1000.0
    by_kind = lambda kind, lo, hi: [e for e in events                        # noqa: E731
                                    if e["event"] == kind and lo < e["time_unix"] <= hi]
    per_event = []
    for d in run["delivered"]:
        t = d["t"]
        resume = next(e for e in events
                      if e["event"] == "first_iteration" and e["time_unix"] > t)
        window = (t, resume["time_unix"])
        stop = next(iter(by_kind("stop", *window)), None)
        evac = next(iter(by_kind("evacuate", *window)), None)
        plan = by_kind("plan", *window)[-1]
        recovery = (by_kind("recovery", *window) or [None])[-1]
        # the first iteration after the restart: its record has the event's iteration and a
        # timestamp (1 s resolution) at most a second or two from the event
        first = min((r for r in records if r["iteration"] == resume["iteration"]),
                    key=lambda r: abs(_record_time(r) - resume["time_unix"]))
        first_s = first["elapsed_ms"] / 1000.0
        first_start = resume["time_unix"] - first_s
        down_from = stop["time_unix"] if stop else t
        old_end = evac["time_unix"] if evac else down_from
        plan_start = plan["time_unix"] - plan["seconds"]
        recover_s = sum(recovery["seconds"].values()) if recovery else 0.0
        recovered = recovery["iteration"] if recovery else 0
        trained = stop["iteration"] if stop else d["iteration_before"]
        lost = trained - recovered
        row = {
            "trace_s": d["ms"] / 1000.0, "action": d["action"], "node": d["node"],
            "kind": d["kind"], "late_s": d["late_s"],
            "detect_s": stop["time_unix"] - t if stop else None,
            "save_s": (evac["time_unix"] - stop["time_unix"]) if evac else None,
            "evacuate_s": evac["seconds"] if evac else None,
            "evacuated_bytes": evac["bytes"] if evac else None,
            "restart_s": plan_start - old_end,
            "replan_s": plan["seconds"], "plan_decision": plan["decision"],
            "plan_nodes": plan["nodes"], "plan_world_size": plan["world_size"],
            "setup_s": first_start - recover_s - plan["time_unix"],
            "recover_s": recover_s,
            "recover_phases_s": recovery["seconds"] if recovery else {},
            "recover_bytes": recovery["bytes"] if recovery else {},
            "first_iteration_s": first_s,
            "worker_start_to_first_iteration_s": resume["seconds"],
            "downtime_s": first_start - down_from,
            "iteration_stopped": trained, "iteration_recovered": recovered,
            "iterations_lost": lost, "lost_s": lost * median_s,
            "rounds": len(by_kind("plan", *window)),
        }
        row["cost_s"] = row["downtime_s"] + row["lost_s"]
        per_event.append(row)
    finished = next(e for e in events if e["event"] == "finished")
    after_t0 = records[run["metrics_at_t0"]:]
    superseded = set()
    seen: set[int] = set()
    for i in range(len(records) - 1, -1, -1):           # a record re-trained later is wasted
        if records[i]["iteration"] in seen:
            superseded.add(i)
        seen.add(records[i]["iteration"])
    busy = sum(r["elapsed_ms"] for r in after_t0) / 1000.0
    useful = sum(r["elapsed_ms"] for i, r in enumerate(records)
                 if i >= run["metrics_at_t0"] and i not in superseded) / 1000.0
    wall = finished["time_unix"] - run["t0"]
    return {
        "events": per_event, "skipped_events": run["skipped"],
        "median_iteration_s": median_s,
        "final_iteration": finished["iteration"],
        "iterations_logged": len(records), "iterations_retrained": len(superseded),
        "wall_s_first_iteration_to_finished": wall,
        "wall_s_nodes_started_to_finished": finished["time_unix"] - run["t_start"],
        "busy_fraction": busy / wall, "useful_fraction": useful / wall,
        "rounds_started_by_benchmark": run["rounds_started"],
        "plan_events": sum(e["event"] == "plan" for e in events),
        "workdir": str(workdir),
    }


# ---- report -------------------------------------------------------------------------------------

COLUMNS = [("trace s", "trace_s", 7), ("event", None, 20), ("late", "late_s", 5),
           ("detect", "detect_s", 6), ("save", "save_s", 5), ("restart", "restart_s", 7),
           ("re-plan", "replan_s", 7), ("setup", "setup_s", 6), ("recover", "recover_s", 7),
           ("1st it", "first_iteration_s", 6), ("down", "downtime_s", 6),
           ("lost it", "iterations_lost", 7), ("lost s", "lost_s", 6), ("cost", "cost_s", 6),
           ("S3 MB", None, 6)]


def print_run(name: str, r: dict) -> None:
    print(f"\n{name}: median iteration {r['median_iteration_s']:.2f} s, "
          f"{r['iterations_logged']} iterations logged for {r['final_iteration']} "
          f"({r['iterations_retrained']} re-trained), {r['wall_s_first_iteration_to_finished']:.0f}"
          f" s from the first iteration to the end: {100 * r['busy_fraction']:.0f}% in "
          f"iterations, {100 * r['useful_fraction']:.0f}% in iterations kept"
          + (f"; not replayed (job done): {r['skipped_events']}" if r["skipped_events"] else ""))
    print("| " + " | ".join(f"{h:>{w}}" for h, _, w in COLUMNS) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for _, _, w in COLUMNS) + "|")
    for e in r["events"]:
        cells = []
        for head, key, width in COLUMNS:
            if head == "event":
                value = f"{e['action']} {e['node']} {e['kind'][:7]}"
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


def mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def summarise(autohet: dict, baseline: dict, notice: bool) -> dict:
    def removes(run):
        return [e for e in run["events"] if e["action"] == "remove"]
    a_down, b_down = (mean(e["downtime_s"] for e in removes(r)) for r in (autohet, baseline))
    a_cost, b_cost = (mean(e["cost_s"] for e in removes(r)) for r in (autohet, baseline))
    lost_notice = [e["iterations_lost"] for e in autohet["events"] if e["kind"] == "notice"]
    a_rec, b_rec = (mean(e["recover_s"] for e in removes(r)) for r in (autohet, baseline))
    return {
        "autohet_mean_recover_per_preemption_s": a_rec,
        "baseline_mean_recover_per_preemption_s": b_rec,
        "recover_ratio_baseline_over_autohet": b_rec / a_rec if a_rec and b_rec else None,
        "preemptions": len(removes(autohet)),
        "autohet_mean_downtime_per_preemption_s": a_down,
        "baseline_mean_downtime_per_preemption_s": b_down,
        "downtime_ratio_baseline_over_autohet": b_down / a_down if a_down and b_down else None,
        "autohet_mean_cost_per_preemption_s": a_cost,
        "baseline_mean_cost_per_preemption_s": b_cost,
        "cost_ratio_baseline_over_autohet": b_cost / a_cost if a_cost and b_cost else None,
        "autohet_mean_downtime_all_events_s": mean(e["downtime_s"] for e in autohet["events"]),
        "baseline_mean_downtime_all_events_s": mean(e["downtime_s"] for e in baseline["events"]),
        "target_downtime_le_fifth_of_baseline": (a_down is not None and b_down is not None
                                                 and a_down <= b_down / 5),
        "iterations_lost_with_notice": lost_notice if notice else None,
        "target_zero_lost_with_notice": (all(n == 0 for n in lost_notice) if notice else None),
    }


def print_summary(s: dict) -> None:
    f = lambda v: "n/a" if v is None else f"{v:.2f}"                      # noqa: E731
    print(f"\npreemptions: {s['preemptions']}; mean downtime per preemption: autohet "
          f"{f(s['autohet_mean_downtime_per_preemption_s'])} s, baseline "
          f"{f(s['baseline_mean_downtime_per_preemption_s'])} s: baseline/autohet = "
          f"{f(s['downtime_ratio_baseline_over_autohet'])} (target >= 5: "
          f"{'met' if s['target_downtime_le_fifth_of_baseline'] else 'MISSED'}); with the "
          f"re-trained iterations (cost): {f(s['autohet_mean_cost_per_preemption_s'])} s vs "
          f"{f(s['baseline_mean_cost_per_preemption_s'])} s = "
          f"{f(s['cost_ratio_baseline_over_autohet'])}x; the recover phase alone: "
          f"{f(s['autohet_mean_recover_per_preemption_s'])} s vs "
          f"{f(s['baseline_mean_recover_per_preemption_s'])} s = "
          f"{f(s['recover_ratio_baseline_over_autohet'])}x; iterations lost with notice: "
          + ("n/a (--no-notice)" if s["iterations_lost_with_notice"] is None else
             f"{s['iterations_lost_with_notice']} (target all 0: "
             f"{'met' if s['target_zero_lost_with_notice'] else 'MISSED'})"))


# ---- main ---------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(ROOT / "configs/traces/synthetic-4node.csv"))
    parser.add_argument("--time-scale", type=float, default=None,
                        help="seconds per trace second (default 1.0; --quick 0.5)")
    parser.add_argument("--iters", type=int, default=None,
                        help="iterations of each job (default 300; --quick 150): enough that "
                             "the job is still training when the last event comes")
    parser.add_argument("--save-interval", type=int, default=10,
                        help="periodic checkpoints (disk + S3) every N iterations (default 10)")
    parser.add_argument("--clock", choices=("training", "wall"), default="training",
                        help="training (default): the trace's clock stops while the job is down, "
                             "so each event comes after the trace's gap of training; wall: "
                             "events at their compressed trace times (one due while the job is "
                             "down waits until it trains again: 'late')")
    parser.add_argument("--no-notice", action="store_true",
                        help="autohet run: the trace's removals are SIGKILLs, not notices")
    parser.add_argument("--quick", action="store_true",
                        help="a shorter replay (trace clock x0.5, 150 iterations): about 5 minutes")
    parser.add_argument("--workdir", default=None,
                        help="keep the runs' files here (default: a temporary directory)")
    parser.add_argument("--out", default=str(ROOT / "bench-out" / "bench-spot.json"),
                        help="JSON results path (default bench-out/bench-spot.json)")
    args = parser.parse_args()
    args.time_scale = args.time_scale or (0.5 if args.quick else 1.0)
    args.iters = args.iters or (150 if args.quick else 300)

    silence_known_megatron_warnings()
    from megatron_autohet.elastic.trace import load_trace
    from s3_server import moto_s3_server

    trace = load_trace(args.trace)
    initial = [e.node for e in trace if e.ms == 0 and e.action == "add"]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-spot-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    print(f"trace {args.trace}: {len(trace) - len(initial)} events after the initial fleet "
          f"{', '.join(initial)}; time scale {args.time_scale:g} ({args.clock} clock); "
          f"{args.iters} iterations, saves "
          f"every {args.save_interval}; removals are "
          f"{'SIGKILLs' if args.no_notice else 'notices'}; workdir {workdir}", flush=True)
    autohet("plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", GLOBAL_BATCH,
            "--micro-batch-size", MICRO_BATCH, "-o", workdir / "plan.yaml")
    warm_data_cache(args.iters)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    runs, analysed = {}, {}
    with moto_s3_server("bench-spot") as s3:
        for mode in ("autohet", "baseline"):
            started = time.time()
            print(f"[{mode}] replaying", flush=True)
            runs[mode] = replay(mode, workdir / mode, trace, initial, args, s3)
            analysed[mode] = analyse(mode, workdir / mode, runs[mode])
            print(f"[{mode}] done in {time.time() - started:.0f} s", flush=True)
    summary = summarise(analysed["autohet"], analysed["baseline"], notice=not args.no_notice)
    print_run("autohet (local checkpoints + peers + S3; removals "
              f"{'killed' if args.no_notice else 'with notice'})", analysed["autohet"])
    print_run("baseline (restart everything from S3: SIGKILL all, local tier wiped, restart)",
              analysed["baseline"])
    print_summary(summary)
    result = {
        "command": {k: v for k, v in vars(args).items()},
        "trace": [{"ms": e.ms, "action": e.action, "node": e.node} for e in trace],
        "setting": {"model": str(MODEL.relative_to(ROOT)),
                    "cluster": str(CLUSTER.relative_to(ROOT)),
                    "global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH,
                    "workers": "CPU (gloo), one per emulated node, OMP_NUM_THREADS=1",
                    "s3": "moto server in the benchmark's process (loopback)",
                    "baseline": "on every membership change: SIGKILL of every node's process "
                                "tree (no emergency save), node-local checkpoint directories "
                                "deleted, job restarted at once on the new fleet (new "
                                "rendezvous id, --nnodes N:N); recovery from S3 only",
                    "cpu_count": os.cpu_count(), "machine": platform.platform(),
                    "python": platform.python_version(),
                    "load_average_1min": {"before": load_before[0],
                                          "after": os.getloadavg()[0]}},
        "autohet": analysed["autohet"], "baseline": analysed["baseline"],
        "replay": {m: {k: v for k, v in r.items()} for m, r in runs.items()},
        "summary": summary,
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
