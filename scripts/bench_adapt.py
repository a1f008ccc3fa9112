#!/usr/bin/env python
"""Adaptive re-planning measured: ``autohet train --autohet-adapt replan`` on an emulated
heterogeneous fleet, against the plans it should end on.

Setup (needs root, iproute2 and cgroup v1's cpu controller; never part of the test suite, the
arithmetic below is unit-tested): scripts/emulate_cluster.py turns the fleet
(``configs/emulated/three-speeds.yaml`` by default) into one process per emulated GPU at its
type's CPU share, in network namespaces joined by shaped links. Every emulated GPU is profiled
in its quota (``autohet profile --as-gpu``, as scripts/bench_emulated.py does): the **true
profile**; ``autohet plan`` on it gives the **true plan**. Each job is ``autohet train`` on the
emulated ranks with ``--metrics-jsonl`` (every iteration's elapsed time and loss) and
``--autohet-measure-window W``; its switches are read from its ranks' console (``adapt:
switched plans after iteration N: ...``). Scenarios, a row each, printed and written to the
JSON as soon as it ends:

* **a, wrong profile**: the plan made from the true profile with two types' entries swapped
  (EMU-MID's figures as EMU-SLOW's and back: each type off by 2x), trained with ``replan``;
  beside it the true plan trained with ``off`` (the throughput to reach, and the losses'
  reference). Reports the switch (iteration, seconds from the job's first iteration to the
  first iteration after it), the measured throughput before and after it and of the true plan,
  and the windows from the start until a window's median reaches 95% of the true plan's.
* **b, straggler**: the true plan with ``replan``; after iteration ``k`` one emulated GPU's
  quota is halved (emulate_cluster.set_share), after iteration ``k2`` restored. Paired with the
  same run in ``off`` (the slowed rate without adapting; the losses' reference) and a fresh plan
  made for the slowed fleet (the cluster with that GPU at speed 0.5) trained on it. Reports the
  rates before, while slow without adapting, after the switch, after the recovery, of the fresh
  plan; the share of what the straggler cost that the switch won back (of the cost, and of what
  the fresh plan can win back: the target's measure), the windows from the slowdown until 80%
  of it is won back and from the recovery until the first plan's rate is back (95% of it).
* **c, steady fleet**: the true plan for ``--iters`` iterations with ``replan`` (the switches;
  the target is none after the first correction), then ``--pairs`` pairs of ``off`` and ``log``
  runs, interleaved (off, log, then log, off, ...) so they share the machine's drift: the
  overhead of log, the mean iteration time (a window's re-plan lands on one iteration, which a
  median would hide) of log over off, paired. And what measuring costs, measured in the run
  (:func:`window_cost`): the seconds the logging rank spends after each window's iteration on
  the window (the gather of every rank's medians, the drift lines, the adapt decision; the
  metrics' ``window_ms``, which every rank waits for) over the run's training time, per mode;
  on two cores the pairs' drift is several percent, this figure is not drowned in it.

**Loss equivalence.** Every adapting run's losses are compared with its reference run's on the
same global batches (same seed and data): up to its first switch with the same plan (b, c) bit
for bit, and from where the layouts differ (a: from the start) within tests/elastic's bound,
``(i - s) * micro-batches * 2^-24`` relative (another layout sums a global batch's
micro-batches in another order), ``s`` the last iteration both ran on one layout. log and off
runs must be bit-identical (log changes nothing the job computes).

**Measuring.** A rate is the global batch over a span's median iteration time (samples/s),
``elapsed_ms`` of the metrics lines; the iteration after a switch (the new plan's warm-up) is
left out of the spans. At a run's start every emulated GPU the plan trains on gets a whole core
until iteration 1 is logged (importing torch and building the model at 0.15 of a core takes a
minute), then its type's share; a GPU the plan leaves idle has its share from the start, since
it measures itself once the plan trains (its re-plans price its type on that). The machine is
shared: the load average (1 minute) before and after each run is in its row, and a quota is a
ceiling, not a guarantee (emulate_cluster.py). ``--keep DIR`` keeps every run's files there
(each rank's console, the plans, each adapting run's measured profile).

The adapting runs price their re-plans in the emulated catalog (``--gpu-catalog``), and the
``replan`` runs hold a process on every emulated GPU (``--cluster``: those the plan leaves idle
wait for a re-plan to use them, in their GPU's quota). While a
run trains, the bench moves each rank's re-plan search process (planner/adapt_process.py, a
child of the rank) out of the rank's cgroup into the cgroup root as soon as it sees it (it
looks every 0.2 s): the search is the work of the host CPU beside a GPU, not of the GPU, so it
must not take the emulated GPU's quota (at 0.3-0.6 of a core, a search and that process's
start-up would slow the GPU it decides for).

    sudo python scripts/bench_adapt.py [--scenarios a,b,c] [--iters 300] [--window 20]
        [--quick] [--json bench-out/bench_adapt.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emulate_cluster as emu  # puts the repository on sys.path
from _bench import silence_known_megatron_warnings, write_json

from megatron_autohet.plan_switch import job_members

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CLUSTER = str(emu.EMULATED_DIR / "three-speeds.yaml")
DEFAULT_MODEL = str(emu.EMULATED_DIR / "emu-gpt.yaml")
SCENARIOS = ("a", "b", "c")
UNIT_ROUNDOFF = 2.0 ** -24          # fp32: the CPU runtime trains in fp32
SWAPPED = ("EMU-MID", "EMU-SLOW")   # scenario a: these two types' profile entries exchanged
BASE_PORT = 29700
SEED = 1234

SWITCH_LINE = re.compile(r"adapt: switched plans after iteration (\d+): (.*?); state saved.*?"
                         r"([0-9.]+) s from the stop to iteration \d+ trained")
DECISION_LINE = re.compile(r"adapt: iterations (\d+)-(\d+)[^:]*: (SWITCH|keep) \((.*?)\): "
                           r"re-plan")


# ---- the report's arithmetic (pure) --------------------------------------------------------------

def read_records(text: str) -> list[dict]:
    """The iteration records of a --metrics-jsonl file's text, in order (validation lines out)."""
    out = []
    for line in text.splitlines():
        if line.strip():
            rec = json.loads(line)
            if "lm_loss" in rec and "elapsed_ms" in rec:
                out.append(rec)
    return out


def switches(console: str) -> list[dict]:
    """The plan switches a job's console reports: the iteration after which it switched, the
    new plan (one phrase), the seconds from the stop to the first iteration trained after it."""
    found = {}
    for m in SWITCH_LINE.finditer(console):
        found[int(m.group(1))] = {"iteration": int(m.group(1)),
                                  "plans": m.group(2), "stop_to_trained_s": float(m.group(3))}
    return [found[k] for k in sorted(found)]


def decisions(console: str) -> list[dict]:
    """Every window's decision line: its iterations, SWITCH or keep, why."""
    out = {}
    for m in DECISION_LINE.finditer(console):
        out[(int(m.group(1)), int(m.group(2)))] = {
            "window": [int(m.group(1)), int(m.group(2))], "switch": m.group(3) == "SWITCH",
            "why": m.group(4)}
    return [out[k] for k in sorted(out)]


def rate(records: list[dict], first: int, last: int, skip: tuple[int, ...] = ()) -> float | None:
    """Samples per second over iterations ``first..last``: the global batch over their median
    iteration time; ``skip``: iterations left out (a switch's first). None: no iteration."""
    times = [r["elapsed_ms"] / 1000 for r in records
             if first <= r["iteration"] <= last and r["iteration"] not in skip]
    if not times:
        return None
    return records[0]["global_batch_size"] / statistics.median(times)


def window_rates(records: list[dict], window: int, skip: tuple[int, ...] = ()) -> list[dict]:
    """Per measurement window (iterations (j-1)W+1 .. jW), its rate."""
    last = max((r["iteration"] for r in records), default=0)
    out = []
    for start in range(1, last + 1, window):
        value = rate(records, start, min(start + window - 1, last), skip)
        if value is not None:
            out.append({"first": start, "last": min(start + window - 1, last), "rate": value})
    return out


def windows_until(windows: list[dict], event: int, reached) -> int | None:
    """How many windows from the one holding iteration ``event + 1`` up to the first whose
    rate satisfies ``reached`` (1: that very window); None: never."""
    count = 0
    for w in windows:
        if w["last"] <= event:
            continue
        count += 1
        if reached(w["rate"]):
            return count
    return None


def won_back(slowed: float, recovered: float, reference: float) -> float | None:
    """The fraction of ``reference - slowed`` that ``recovered`` wins back (None: nothing to
    win)."""
    if reference <= slowed:
        return None
    return (recovered - slowed) / (reference - slowed)


def compare_losses(run: list[dict], reference: list[dict], same_layout_until: int,
                   microbatches: int) -> dict:
    """The run's losses against the reference's, iteration by iteration (up to the reference's
    last): bit for bit up to
    ``same_layout_until`` (the last iteration both trained on one layout), then within
    ``(i - s) * microbatches * 2^-24`` relative (module doc)."""
    ref = {r["iteration"]: r["lm_loss"] for r in reference}
    last = max(ref, default=0)
    worst_rel, worst_ratio, exact, iterations, missing = 0.0, 0.0, True, 0, []
    for r in run:
        i = r["iteration"]
        if i > last:                 # a shorter reference: compared over its iterations
            continue
        if i not in ref:
            missing.append(i)
            continue
        iterations += 1
        rel = abs(r["lm_loss"] - ref[i]) / abs(ref[i])
        worst_rel = max(worst_rel, rel)
        if i <= same_layout_until:
            exact = exact and r["lm_loss"] == ref[i]
        else:
            worst_ratio = max(worst_ratio, rel / ((i - same_layout_until) * microbatches
                                                  * UNIT_ROUNDOFF))
    logged = [r["iteration"] for r in run]
    return {"iterations": iterations, "bitwise_until": min(same_layout_until, last),
            "bitwise_equal_until": exact, "max_rel_diff": worst_rel,
            "max_over_bound": worst_ratio, "once_each": len(logged) == len(set(logged)),
            "missing_in_reference": missing,
            "equivalent": exact and worst_ratio <= 1.0 and not missing
            and len(logged) == len(set(logged))}


def swap_profile_types(profile: dict, a: str, b: str) -> dict:
    """A profile's dict (profiling/profile.py's file form) with GPU types ``a`` and ``b``'s
    entries exchanged: each priced as the other (scenario a's wrong profile)."""
    rename = {a: b, b: a}
    return dict(profile, entries=[dict(e, gpu=rename.get(e["gpu"], e["gpu"]))
                                  for e in profile["entries"]])


def first_rank_of_gpu(plan: dict, node: str, local_rank: int) -> int | None:
    """The rank of a plan's dict on that GPU (None: idle in the plan)."""
    return next((r["rank"] for r in plan["ranks"]
                 if (r["node"], r["local_rank"]) == (node, local_rank)), None)


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def fmt_count(value) -> str:
    return "never" if value is None else str(value)


def window_cost(records: list[dict], warmup: int = 2) -> float:
    """The windows' own seconds (``window_ms``) over the iterations' (``elapsed_ms``), both
    after ``warmup`` (module doc, c)."""
    kept = [r for r in records if r["iteration"] > warmup]
    return (sum(r.get("window_ms") or 0.0 for r in kept)
            / sum(r["elapsed_ms"] for r in kept))


def overhead(off: list[dict], log: list[dict], warmup: int = 2) -> float:
    """log's mean iteration time over off's, minus 1 (iterations after ``warmup``)."""
    def mean(records):
        return statistics.fmean(r["elapsed_ms"] for r in records if r["iteration"] > warmup)
    return mean(log) / mean(off) - 1.0


# ---- one job on the emulated fleet ---------------------------------------------------------------

@dataclass
class Run:
    name: str
    records: list[dict]
    console: str
    status: int
    wall_s: float
    load: tuple[float, float]
    share_changes: list[dict] = field(default_factory=list)

    @property
    def switches(self) -> list[dict]:
        return switches(self.console)

    def summary(self) -> dict:
        return {"name": self.name, "status": self.status, "wall_s": round(self.wall_s, 1),
                "iterations": len(self.records), "switches": self.switches,
                "decisions": decisions(self.console), "share_changes": self.share_changes,
                "load_average_1min": {"before": self.load[0], "after": self.load[1]},
                "iterations_ms": [round(r["elapsed_ms"], 1) for r in self.records],
                "lm_loss": [r["lm_loss"] for r in self.records]}


class Fleet:
    """The emulated fleet of the bench, its data, plans and jobs."""

    def __init__(self, args, tmp: Path, cluster: "emu.EmulatedCluster", fleet):
        self.args, self.tmp, self.cluster, self.fleet = args, tmp, cluster, fleet
        self.port = BASE_PORT
        self.gbs = args.micro_batch_size * args.microbatches

    def plan(self, name: str, profile: Path, cluster_file: str | None = None) -> Path:
        """``autohet plan`` on a profile; the plan's file."""
        out = self.tmp / f"{name}.yaml"
        cmd = [sys.executable, "-m", "megatron_autohet.cli.main", "plan",
               "--cluster", cluster_file or self.args.cluster, "--model", self.args.model,
               "--profile", str(profile), "--gpu-catalog", str(emu.DEFAULT_CATALOG),
               "--global-batch-size", str(self.gbs),
               "--micro-batch-size", str(self.args.micro_batch_size),
               "--time-limit", str(self.args.time_limit), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            raise SystemExit(f"bench_adapt: autohet plan failed:\n{done.stdout}{done.stderr}")
        (self.tmp / f"{name}.plan.txt").write_text(done.stdout)
        return out

    def train(self, name: str, plan_path: Path, adapt: str, iters: int,
              slow: tuple[tuple[str, int], int, int] | None = None,
              slow_from_start: tuple[str, int] | None = None,
              stop_after: int | None = None) -> Run:
        """``autohet train`` of ``plan_path`` on the emulated ranks, ``--iters iters``.
        ``slow``: (GPU, k, k2), that GPU at half its share after iteration k, back after k2 (k2
        past the run: never); ``slow_from_start``: that GPU at half its share from iteration 1;
        ``stop_after``: ``--exit-interval`` (a reference shorter than the run it is compared
        with, on the same learning-rate schedule: the schedule's length is --iters)."""
        import yaml

        from megatron_autohet.plan import load_plan

        plan = load_plan(plan_path)
        gpus = [(r.node, r.local_rank) for r in plan.ranks]
        if adapt == "replan":
            # a process on every GPU of the fleet, those the plan leaves idle waiting for a
            # re-plan to use them (autohet train --cluster)
            gpus = list(job_members(plan, self.fleet.cluster, str(plan_path), self.args.cluster))
        placements = emu.place_ranks(self.fleet, gpus, self.args.prefix)
        by_gpu = {(p.node, p.local_rank): p for p in placements}
        work = self.tmp / name
        work.mkdir()
        metrics = work / "metrics.jsonl"
        cmd = [sys.executable, "-m", "megatron_autohet.cli.main"] + train_args(
            plan_path, self.args.model, iters, self.args.window, adapt, work,
            self.tmp / "data", stop_after, cluster=self.args.cluster)
        if self.args.keep and adapt != "off":
            cmd += ["--autohet-measured-profile", str(work / "measured-profile.yaml")]
        self.port += 1
        share = {gpu: self.fleet.cpu_share[p.gpu] for gpu, p in by_gpu.items()}
        if slow_from_start in share:    # a plan may leave that GPU idle: nothing to slow
            share[slow_from_start] /= 2
        events = [(1, dict(share), "shares")]
        if slow is not None:
            gpu, k, k2 = slow
            events += [(k, {gpu: share[gpu] / 2}, "slowed"), (k2, {gpu: share[gpu]}, "restored")]
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        procs = []
        trains = {(r.node, r.local_rank) for r in plan.ranks}
        for p in placements:
            env = {**emu.rank_env(p, placements[0], self.port), "PYTHONPATH": str(ROOT)}
            procs.append(self.cluster.spawn(p, cmd, env, work / f"rank{p.rank}.log"))
            # a whole core while starting up (module doc), the shares from iteration 1 on; a
            # GPU the plan leaves idle measures itself once the plan trains
            # (plan_switch.measure_idle_gpu): at its share from the start
            gpu = (p.node, p.local_rank)
            emu.set_share(p.cgroup, 1.0 if gpu in trains else share[gpu])
        changes, status, moved = [], None, 0
        deadline = started + self.args.timeout
        while status is None:
            last = _last_iteration(metrics)
            while events and last >= events[0][0]:
                at, shares, what = events.pop(0)
                for gpu, value in shares.items():
                    emu.set_share(by_gpu[gpu].cgroup, value)
                changes.append({"after_iteration": last, "what": what,
                                "shares": {f"{g[0]}:{g[1]}": v for g, v in shares.items()}})
            moved += search_to_host([p.cgroup for p in placements])
            codes = [proc.poll() for proc in procs]
            if any(c not in (None, 0) for c in codes):
                status = next(c for c in codes if c not in (None, 0))
            elif all(c == 0 for c in codes):
                status = 0
            elif time.monotonic() > deadline:
                status = 124
            else:
                time.sleep(0.2)
        wall = time.monotonic() - started
        for proc in procs:
            if proc.poll() is None:
                emu._stop_session(proc)
        console = "\n".join((work / f"rank{p.rank}.log").read_text(errors="replace")
                            for p in placements)
        records = read_records(metrics.read_text()) if metrics.exists() else []
        run = Run(name, records, console, status, wall, (load_before, os.getloadavg()[0]),
                  changes)
        (work / "plan.yaml").write_text(yaml.safe_dump(plan.to_dict()))
        if status != 0:
            tail = "\n".join(f"---- rank {p.rank}\n" + (work / f"rank{p.rank}.log").read_text(
                errors="replace")[-2000:] for p in placements)
            raise SystemExit(f"bench_adapt: {name} ended with status {status}:\n{tail}")
        progress(f"{name}: {len(records)} iterations in {wall:.0f} s, "
                 f"{len(run.switches)} switch(es), load {load_before:.1f} -> "
                 f"{run.load[1]:.1f}, {moved} search process(es) moved to the host")
        return run


SEARCH_MODULE = "megatron_autohet.planner.adapt_process"


def search_to_host(cgroups: list[Path], root: Path = emu.CGROUP_CPU_ROOT) -> int:
    """Move the re-plan search processes in ``cgroups`` (the ranks') to the cgroup ``root``
    (the module doc's host CPU); returns how many moved."""
    moved = 0
    for cgroup in cgroups:
        try:
            pids = (cgroup / "cgroup.procs").read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if SEARCH_MODULE.encode() in cmdline:
                    (root / "cgroup.procs").write_text(pid)
                    moved += 1
            except OSError:         # it ended meanwhile
                continue
    return moved


def train_args(plan: Path, model: str, iters: int, window: int, adapt: str, work: Path,
               data_dir: Path, stop_after: int | None = None,
               cluster: str | None = None) -> list[str]:
    """``autohet train``'s arguments of one run. Every run of a scenario has the same
    ``--iters`` (the learning-rate schedule's length, so their losses compare); a shorter
    reference stops at ``stop_after`` (``--exit-interval``). It saves only at its end (or a
    switch: the state moves through the job's checkpoints). A ``replan`` run gets the fleet's
    ``cluster`` file, whose GPUs its plan leaves idle it holds a process on."""
    args = ["train", "--plan", str(plan), "--model", model, "--iters", str(iters),
            "--seed", str(SEED), "--metrics-jsonl", str(work / "metrics.jsonl"),
            "--data-dir", str(data_dir), "--autohet-measure-window", str(window),
            "--autohet-adapt", adapt, "--save", str(work / "ckpt"), "--save-interval", str(iters)]
    if adapt != "off":
        args += ["--gpu-catalog", str(emu.DEFAULT_CATALOG)]
    if adapt == "replan" and cluster is not None:
        args += ["--cluster", cluster]
    if stop_after is not None and stop_after < iters:
        args += ["--exit-interval", str(stop_after)]
    return args


def _last_iteration(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    lines = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:     # a line being written
            continue
        if "lm_loss" in rec:
            return int(rec["iteration"])
    return 0


def progress(message: str) -> None:
    print(f"[bench_adapt {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- the scenarios -------------------------------------------------------------------------------

def scenario_a(bench: Fleet, true_profile: Path, true_plan: Path) -> dict:
    args = bench.args
    wrong = bench.tmp / "wrong-profile.yaml"
    import yaml
    wrong.write_text(yaml.safe_dump(swap_profile_types(
        yaml.safe_load(true_profile.read_text()), *SWAPPED)))
    wrong_plan = bench.plan("plan-wrong", wrong)
    adapting = bench.train("a-replan-from-wrong", wrong_plan, "replan", args.iters)
    reference = bench.train("a-true-plan-off", true_plan, "off", args.iters)
    sw = adapting.switches
    first = sw[0]["iteration"] if sw else None
    after_skip = tuple(s["iteration"] + 1 for s in sw)
    true_rate = rate(reference.records, 2, args.iters)
    windows = window_rates(adapting.records, args.window, after_skip)
    seconds = None
    if first is not None:
        seconds = (sum(r["elapsed_ms"] for r in adapting.records if r["iteration"] <= first)
                   / 1000 + sw[0]["stop_to_trained_s"])
    return {"scenario": "a", "what": f"wrong profile ({SWAPPED[0]} and {SWAPPED[1]} swapped)",
            "plans": {"wrong": _plan_text(bench, "plan-wrong"),
                      "true": _plan_text(bench, "plan-true"),
                      "same": wrong_plan.read_text() == true_plan.read_text()},
            "switch_iterations": [s["iteration"] for s in sw],
            "seconds_to_switch": seconds,
            "rate_before": rate(adapting.records, 2, first or args.iters),
            "rate_after": (rate(adapting.records, first + 1, args.iters, after_skip)
                           if first else None),
            "rate_true_plan": true_rate,
            "windows_to_95pct": windows_until(windows, 0, lambda v: v >= 0.95 * true_rate),
            "target": "95% of the true plan's rate within 3 windows of the start",
            "losses": compare_losses(adapting.records, reference.records, 0,
                                     args.microbatches),
            "loss_bound": "against the true plan uninterrupted; layouts differ from iteration 1",
            "window_rates": windows, "runs": [adapting.summary(), reference.summary()]}


def scenario_b(bench: Fleet, true_plan: Path) -> dict:
    from megatron_autohet.plan import load_plan
    import yaml

    args = bench.args
    plan = load_plan(true_plan)
    node, local = args.straggler.split(":")
    gpu = (node, int(local))
    if first_rank_of_gpu(plan.to_dict(), *gpu) is None:
        raise SystemExit(f"bench_adapt: --straggler {args.straggler}: the true plan leaves that "
                         "GPU idle; name a GPU it trains on")
    k, k2 = args.slow_at, args.restore_at
    iters = args.straggler_iters
    adapting = bench.train("b-replan-straggler", true_plan, "replan", iters, (gpu, k, k2))
    # without adapting: through the slowed span and a window after the recovery
    paired = bench.train("b-off-straggler", true_plan, "off", iters, (gpu, k, k2),
                         stop_after=k2 + args.window)
    slowed_cluster = bench.tmp / "slowed-cluster.yaml"
    data = yaml.safe_load(Path(args.cluster).read_text())
    data["slow_gpus"] = [{"node": node, "local_rank": int(local), "speed": 0.5}]
    slowed_cluster.write_text(yaml.safe_dump(data))
    fresh_plan = bench.plan("plan-slowed", bench.tmp / "true-profile.yaml", str(slowed_cluster))
    fresh = bench.train("b-fresh-plan-slowed", fresh_plan, "off", args.fresh_iters,
                        slow_from_start=gpu)
    # the share changes land after the iteration the bench saw logged
    slowed_at = next(c["after_iteration"] for c in adapting.share_changes if c["what"] == "slowed")
    restored_at = next((c["after_iteration"] for c in adapting.share_changes
                        if c["what"] == "restored"), None)
    sw = adapting.switches
    skip = tuple(s["iteration"] + 1 for s in sw)
    during = [s for s in sw if slowed_at < s["iteration"] <= (restored_at or iters)]
    after = [s for s in sw if restored_at is not None and s["iteration"] > restored_at]
    slow_end = restored_at or iters
    before = rate(adapting.records, 2, slowed_at)
    slow_off = rate(paired.records, slowed_at + 2, slow_end)
    fresh_rate = rate(fresh.records, 2, args.fresh_iters)
    after_switch = (rate(adapting.records, during[0]["iteration"] + 1, slow_end, skip)
                    if during else None)
    after_recovery_from = (after[0]["iteration"] + 1) if after else (restored_at or iters) + 1
    after_recovery = (rate(adapting.records, after_recovery_from, iters, skip)
                      if restored_at is not None else None)
    windows = window_rates(adapting.records, args.window, skip)
    target = (slow_off + 0.8 * (fresh_rate - slow_off)) if fresh_rate > slow_off else None
    slowed_windows = [w for w in windows if w["last"] <= slow_end]
    return {"scenario": "b", "what": f"straggler: {args.straggler} at half its share after "
                                     f"iteration {k}, restored after {k2}",
            "slowed_after_iteration": slowed_at, "restored_after_iteration": restored_at,
            "switch_iterations": [s["iteration"] for s in sw],
            "rate_before": before, "rate_slow_off": slow_off, "rate_after_switch": after_switch,
            "rate_after_recovery": after_recovery, "rate_fresh_plan_slowed": fresh_rate,
            "won_back_of_cost": (won_back(slow_off, after_switch, before)
                                 if after_switch else None),
            "won_back_of_winnable": (won_back(slow_off, after_switch, fresh_rate)
                                     if after_switch else None),
            "windows_to_80pct_won_back": (None if target is None else windows_until(
                slowed_windows, slowed_at, lambda v: v >= target)),
            "windows_to_first_rate_back": (None if restored_at is None else windows_until(
                windows, restored_at, lambda v: v >= 0.95 * before)),
            "target": "80% of what the fresh plan wins back within 3 windows of the slowdown; "
                      "95% of the first plan's rate within 3 windows of the recovery",
            "plans": {"first": _plan_text(bench, "plan-true"),
                      "fresh_for_slowed": _plan_text(bench, "plan-slowed")},
            "losses": compare_losses(adapting.records, paired.records,
                                     sw[0]["iteration"] if sw else iters,
                                     args.microbatches),
            "loss_bound": "against the same first plan uninterrupted (--autohet-adapt off, same "
                          "slowdown): bit for bit up to the first switch",
            "window_rates": windows,
            "runs": [adapting.summary(), paired.summary(), fresh.summary()]}


def scenario_c(bench: Fleet, true_plan: Path) -> dict:
    args = bench.args
    steady = bench.train("c-replan-steady", true_plan, "replan", args.iters)
    pairs = []
    for p in range(args.pairs):
        order = ("off", "log") if p % 2 == 0 else ("log", "off")
        runs = {mode: bench.train(f"c-{mode}-{p}", true_plan, mode, args.iters,
                                  stop_after=args.overhead_iters) for mode in order}
        pairs.append({"order": list(order), "overhead": overhead(runs["off"].records,
                                                                 runs["log"].records),
                      "losses_log_vs_off": compare_losses(runs["log"].records,
                                                          runs["off"].records,
                                                          args.overhead_iters,
                                                          args.microbatches),
                      "window_cost": {m: window_cost(runs[m].records) for m in order},
                      "runs": [runs[m].summary() for m in order]})
    sw = steady.switches
    reference = next(r for r in pairs[0]["runs"] if r["name"].startswith("c-off"))
    ref_records = [{"iteration": i + 1, "lm_loss": v}
                   for i, v in enumerate(reference["lm_loss"])]
    return {"scenario": "c", "what": f"steady fleet, the true plan, {args.iters} iterations",
            "switch_iterations": [s["iteration"] for s in sw],
            "switches_after_first": max(0, len(sw) - 1),
            "rate_steady": rate(steady.records, 2, args.iters,
                                tuple(s["iteration"] + 1 for s in sw)),
            "log_overhead": statistics.fmean(p["overhead"] for p in pairs),
            "log_overhead_per_pair": [p["overhead"] for p in pairs],
            # measured in the runs: the windows' own seconds over the training's, per mode
            "window_cost": {"replan": window_cost(steady.records),
                            **{m: statistics.fmean(p["window_cost"][m] for p in pairs)
                               for m in ("off", "log")}},
            "target": "no switch after the first correction; log's overhead <= 1% of an "
                      "iteration",
            "losses": compare_losses(steady.records, ref_records,
                                     sw[0]["iteration"] if sw else args.iters,
                                     args.microbatches),
            "loss_bound": "the replan run against off on the same plan: bit for bit up to its "
                          "first switch (all of it without one), over off's iterations",
            "pairs": pairs, "runs": [steady.summary()]}


def _plan_text(bench: Fleet, name: str) -> str:
    """The plan table line autohet plan printed (its layout in one line)."""
    path = bench.tmp / f"{name}.plan.txt"
    if not path.exists():
        return ""
    from megatron_autohet.plan import load_plan
    from megatron_autohet.plan_switch import describe_plan

    return describe_plan(load_plan(bench.tmp / f"{name}.yaml"))


# ---- the table -----------------------------------------------------------------------------------

def row_lines(row: dict) -> list[str]:
    """A scenario's row as lines of the table."""
    s, loss = row["scenario"], row["losses"]
    losses = (f"losses {'equivalent' if loss['equivalent'] else 'NOT equivalent'} "
              f"(max rel diff {loss['max_rel_diff']:.2g}, {loss['max_over_bound']:.2g} of the "
              f"bound, bit for bit to iteration {loss['bitwise_until']}: "
              f"{'yes' if loss['bitwise_equal_until'] else 'NO'})")
    if s == "a":
        return [f"a  wrong profile: switches after {row['switch_iterations'] or 'none'}"
                f" ({fmt_rate(row['seconds_to_switch'])} s to the switch); samples/s before "
                f"{fmt_rate(row['rate_before'])}, after {fmt_rate(row['rate_after'])}, true plan "
                f"{fmt_rate(row['rate_true_plan'])}; windows to 95%: "
                f"{fmt_count(row['windows_to_95pct'])} (target <= 3)", "   " + losses]
    if s == "b":
        return [f"b  straggler: slowed after {row['slowed_after_iteration']}, restored after "
                f"{row['restored_after_iteration']}; switches after "
                f"{row['switch_iterations'] or 'none'}; samples/s before "
                f"{fmt_rate(row['rate_before'])}, slow without adapting "
                f"{fmt_rate(row['rate_slow_off'])}, after the switch "
                f"{fmt_rate(row['rate_after_switch'])}, after the recovery "
                f"{fmt_rate(row['rate_after_recovery'])}, fresh plan for the slowed fleet "
                f"{fmt_rate(row['rate_fresh_plan_slowed'])}",
                f"   won back {_pct(row['won_back_of_cost'])} of the cost, "
                f"{_pct(row['won_back_of_winnable'])} of the winnable; windows to 80%: "
                f"{fmt_count(row['windows_to_80pct_won_back'])}, to the first rate after the "
                f"recovery: {fmt_count(row['windows_to_first_rate_back'])} (targets <= 3)",
                "   " + losses]
    return [f"c  steady fleet: switches after {row['switch_iterations'] or 'none'} "
            f"({row['switches_after_first']} after the first; target 0); samples/s "
            f"{fmt_rate(row['rate_steady'])}; log over off {row['log_overhead']:+.2%} "
            f"(pairs: {', '.join(f'{v:+.2%}' for v in row['log_overhead_per_pair'])}; target "
            f"<= 1%)", "   measured in the runs, the windows' own time (gather, drift lines, "
            "decision) over the training's: " + ", ".join(
                f"{m} {v:.2%}" for m, v in row["window_cost"].items()) + " (target <= 1%)",
            "   " + losses + "; log vs off: " + ", ".join(
                "bit for bit" if p["losses_log_vs_off"]["equivalent"] else "DIFFER"
                for p in row["pairs"])]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


# ---- main ----------------------------------------------------------------------------------------

# --iters is scenarios a and c's; b runs --straggler-iters (a switch back after the recovery
# needs the hold's windows and iterations enough to pay the switch back).
QUICK = {"iters": 60, "window": 5, "microbatches": 8, "straggler_iters": 160, "slow_at": 15,
         "restore_at": 50, "fresh_iters": 15, "overhead_iters": 20, "pairs": 2,
         "profile_iters": 6}
FULL = {"iters": 300, "window": 20, "microbatches": 8, "straggler_iters": 400, "slow_at": 60,
        "restore_at": 200, "fresh_iters": 60, "overhead_iters": 100, "pairs": 3,
        "profile_iters": 15}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="a,b,c",
                        help="comma-separated of a (wrong profile), b (straggler), c (steady "
                             "fleet); default a,b,c")
    parser.add_argument("--quick", action="store_true",
                        help="the smoke configuration: " + ", ".join(
                            f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                        + " (flags given explicitly win)")
    for key, default in FULL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                            help=f"default {default} ({QUICK[key]} with --quick)")
    parser.add_argument("--cluster", default=DEFAULT_CLUSTER, metavar="C.yaml")
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="M.yaml")
    parser.add_argument("--micro-batch-size", type=int, default=4,
                        help="default 4 (scripts/bench_emulated.py says why)")
    parser.add_argument("--straggler", default="mid:0", metavar="NODE:GPU",
                        help="scenario b's GPU (default mid:0)")
    parser.add_argument("--true-profile", default=None, metavar="P.yaml",
                        help="the fleet's true profile from an earlier run (its JSON's "
                             "true_profile, saved as YAML) instead of profiling it "
                             "(default: profile every emulated GPU in its quota)")
    parser.add_argument("--time-limit", type=float, default=20.0, help="planner search budget")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="a new directory the runs' files are kept in (each rank's console, "
                             "the metrics, the plans, the profiles; each adapting run's measured "
                             "profile, --autohet-measured-profile); default a temporary one, "
                             "removed at the end")
    parser.add_argument("--prefix", default="ahadapt")
    parser.add_argument("--json", default=str(ROOT / "bench-out" / "bench_adapt.json"))
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS]
    problems = []
    if bad or not scenarios:
        problems.append(f"--scenarios: got {args.scenarios!r}; allowed: a comma-separated "
                        f"subset of {', '.join(SCENARIOS)}")
    for key in FULL:
        if getattr(args, key) < 1:
            problems.append(f"--{key.replace('_', '-')}: got {getattr(args, key)}; allowed: "
                            "a positive integer")
    if not problems and not args.slow_at < args.restore_at:
        problems.append(f"--restore-at: got {args.restore_at}; allowed: after --slow-at "
                        f"({args.slow_at})")
    if not re.fullmatch(r"[^:]+:\d+", args.straggler):
        problems.append(f"--straggler: got {args.straggler!r}; allowed: NODE:GPU, e.g. mid:0")
    if problems:
        parser.exit(2, f"bench_adapt: error: {problems[0]}\n")
    args.scenarios = scenarios
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    silence_known_megatron_warnings()
    emu.require_root()
    emu.raise_on_sigterm()
    result = {"command": " ".join(["scripts/bench_adapt.py"] + argv),
              "config": {k: v for k, v in vars(args).items() if k != "json"},
              "rows": [], "interrupted": False}
    if args.keep:
        tmp = Path(args.keep)
        tmp.mkdir(parents=True, exist_ok=False)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="bench-adapt-"))
    status = 0
    try:
        from megatron_autohet.data.batches import DataOptions, resolve_data_path
        from megatron_autohet.profiling.profile import Profile
        import bench_emulated

        resolve_data_path(DataOptions(64, 1, 1, data_dir=str(tmp / "data")))
        fleet = emu.load_fleet(args.cluster)
        with emu.EmulatedCluster(fleet, args.prefix) as cluster:
            bench = Fleet(args, tmp, cluster, fleet)
            true_profile = tmp / "true-profile.yaml"
            if args.true_profile:
                Profile.load(args.true_profile).save(true_profile)
            else:
                progress(f"profiling {', '.join(fleet.cpu_share)} in their quotas")
                placements = emu.place_ranks(fleet, prefix=args.prefix)
                bench_emulated.profile_fleet(
                    cluster, placements, args.model, tmp, args.micro_batch_size,
                    args.profile_iters, args.timeout).save(true_profile)
            result["true_profile"] = Profile.load(true_profile).to_dict()
            true_plan = bench.plan("plan-true", true_profile)
            result["true_plan"] = _plan_text(bench, "plan-true")
            progress(f"true plan: {result['true_plan']}")
            for s in args.scenarios:
                if s == "a":
                    row = scenario_a(bench, true_profile, true_plan)
                elif s == "b":
                    row = scenario_b(bench, true_plan)
                else:
                    row = scenario_c(bench, true_plan)
                result["rows"].append(row)
                print("\n".join(row_lines(row)), flush=True)
                write_json(result, args.json)
    except KeyboardInterrupt as stop:
        result["interrupted"] = True
        status = 128 + int(str(stop).split()[-1]) if str(stop).startswith("signal") else 130
        print(f"bench_adapt: interrupted ({stop or 'SIGINT'}); the fleet is torn down, "
              f"{len(result['rows'])} row(s) kept", file=sys.stderr)
    finally:
        if args.keep:
            print(f"bench_adapt: the runs' files are in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        write_json(result, args.json)
    return status


if __name__ == "__main__":
    sys.exit(main())
