#!/usr/bin/env python
"""Measure plans, not only predict them: our plan and its baselines trained on an emulated
heterogeneous cluster, predicted iteration times set against measured ones.

Setup (needs root, iproute2 and cgroup v1's cpu controller; never part of the test suite; the
arithmetic below is unit-tested): scripts/emulate_cluster.py turns each fleet of
``configs/emulated/`` into processes at different CPU shares (the GPU types) in network namespaces
joined by tbf-shaped veths (the NICs), a zone's nodes on a bridge of their own and the link
between two zones delayed and rate-limited (netem). For each fleet, in one run:

1. **Profile** every emulated GPU with ``autohet profile --as-gpu TYPE`` inside its quota, all
   at once as they will train and each for about the same time (a faster type runs more
   iterations), so the profile holds the emulated speeds beside busy neighbours; a type's
   figures are the mean over its GPUs.
2. **Plan** with that profile: ``planner.compare.compare`` gives our plan and the baselines of
   ``autohet compare`` (the Megatron-LM grid, Whale-style, the fastest type alone; on a fleet
   across zones, ``two-zones.yaml``, the zone-oblivious and the best single-zone plan); each is
   written as a plan YAML and priced by the cost model (the predicted iteration time and its
   terms: pipeline, gradient sync, optimizer).
3. **Train** every plan on the emulated cluster: one long-lived process per emulated GPU, which
   for each plan in turn joins a process group of that plan's ranks (a GPU the plan leaves idle
   waits), builds the runtime's :class:`HeteroTrainer` and trains ``--warmup`` untimed then
   ``--iters`` timed iterations; ``--rounds`` rounds, the plans' order rotating every round, so
   the plans share the machine's noise. An iteration's time is the slowest rank's wall time of
   ``train_step`` from a barrier. Each rank also stamps, from that barrier, the end of its
   pipeline schedule, gradient sync, loss/grad-norm reduction + clipping and optimizer step, and
   sums its forward and backward compute (megatron-core's ``forward_step`` / ``backward_step``).
4. **Report** (table + JSON) per plan: predicted vs measured iteration time (median) and the
   relative error; the measured speedup of our plan over each baseline next to the predicted
   one; and, per cost-model term, predicted vs measured:

   * pipeline: the latest rank's end of schedule;
   * of which compute: the cost model's 1F1B formula fed the in-run per-stage compute instead of
     the profile's ("repriced"): predicted vs repriced is the profile's (compute term's) error,
     repriced vs measured the schedule formula's (P2P time and overlap, bubble); P2P is priced
     in the profile's precision, fp32 as the CPU runtime sends it;
   * sync, norm + clip, optimizer: the latest rank's end of each phase minus the latest end of
     the one before (norm + clip is not a term of the cost model);

   and the error split into these parts (:func:`error_contributions`), the largest named.

5. **Variants** (``--variants``): twins of the plans above trained in the same rounds, so each
   pair shares the machine's noise: every plan that syncs gradients (a predicted sync) and runs
   one chunk per stage again with its gradient reduce overlapped with the backward
   (``overlap_grad_reduce``), and our plan with the other choice of virtual stages (v = 2 on
   the pipelines that can take it where the planner chose one chunk per stage; the planner's
   own one-chunk plan, ``virtual_stages=False``, where it chose more). Their table
   (:func:`variant_rows`): an overlap twin against the target "iteration time at most the
   plain plan's minus 70% of the plain plan's measured gradient sync", an interleaving twin
   against "the interleaved plan measured faster than the one-chunk plan, predicted within
   10%".

The load average (1 minute) before and after each fleet's run is recorded: the machine's other
jobs take CPU a quota does not guarantee, so figures measured under load are not the product's
accuracy.

    sudo python scripts/bench_emulated.py [--fleets configs/emulated/three-speeds.yaml ...]
        [--rounds 3] [--iters 4] [--warmup 1] [--variants] [--json bench-out/bench_emulated.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emulate_cluster as emu  # puts the repository on sys.path
from _bench import silence_known_megatron_warnings, write_json


ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FLEETS = [str(emu.EMULATED_DIR / "three-speeds.yaml"),
                  str(emu.EMULATED_DIR / "three-speeds-slow-link.yaml"),
                  str(emu.EMULATED_DIR / "two-zones.yaml")]
DEFAULT_MODEL = str(emu.EMULATED_DIR / "emu-gpt.yaml")
PORT = 29611
SEED = 1234
OURS = "autohet (ours)"
PHASES = ("schedule", "sync", "norm", "optimizer")     # train_step's parts, in order
OVERLAP = " + overlapped sync"     # a plan's twin with its gradient reduce overlapped
FLAT_OURS = OURS + ", v=1"          # our plan searched with one chunk per stage
INTERLEAVED_OURS = OURS + ", v=2"   # our one-chunk plan cut into 2 chunks per stage
# --variants' targets: overlap hides at least this much of the plain plan's measured sync; an
# interleaved plan's prediction within this of its measurement
OVERLAP_HIDDEN = 0.70
INTERLEAVE_ERROR = 0.10


# ---- the report's arithmetic (pure) --------------------------------------------------------------

def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured: positive when the model is pessimistic."""
    return (predicted - measured) / measured


def iteration_times(per_rank: list[list[float]]) -> list[float]:
    """Per iteration, the slowest rank's time (ranks in rows, iterations in columns)."""
    return [max(column) for column in zip(*per_rank)]


def phase_times(marks: list[dict[str, float]]) -> dict[str, float]:
    """One iteration's phases from every rank's phase-end stamps (seconds since the barrier):
    each phase ends when its latest rank ends it; its time is that minus the previous phase's
    end (the first phase, the schedule, from 0)."""
    out, previous = {}, 0.0
    for phase in PHASES:
        end = max(m[phase] for m in marks)
        out[phase] = end - previous
        previous = max(previous, end)
    return out


def median_phases(per_iteration: list[dict[str, float]]) -> dict[str, float]:
    return {p: statistics.median(it[p] for it in per_iteration) for p in PHASES}


def repriced_pipeline_s(stages: list[dict], num_microbatches: int) -> float:
    """The cost model's 1F1B formula (cost_model.pipeline_time_s) over stages given as
    ``{"compute_s": f + b per micro-batch, "p2p_s": outgoing boundary per micro-batch}``."""
    from megatron_autohet.cost_model import pipeline_time_s

    return pipeline_time_s([s["compute_s"] + s["p2p_s"] for s in stages], num_microbatches)


def speedup_rows(plans: list[dict]) -> list[dict]:
    """Our plan's speedup over every baseline, predicted (ratio of predicted times) and measured
    (ratio of median measured times), and how far the measured one is from the predicted."""
    ours = next(p for p in plans if p["name"] == OURS)
    rows = []
    for p in plans:
        if p["name"] == OURS:
            continue
        predicted = p["predicted_s"] / ours["predicted_s"]
        measured = p["measured_s"] / ours["measured_s"]
        rows.append({"baseline": p["name"], "predicted_speedup": predicted,
                     "measured_speedup": measured,
                     "speedup_error": relative_error(predicted, measured),
                     "ours_measured_faster": measured > 1.0})
    return rows


def variant_rows(plans: list[dict]) -> list[dict]:
    """The ``--variants`` pairs among the plans' summaries (module doc, step 5): per overlap
    twin, the plain plan's and the twin's measured time, the plain plan's measured sync, the
    seconds hidden and the target met; per interleaving pair (ours, v > 1 against v = 1), both
    measured, the interleaved one's prediction error and the target met."""
    by_name = {p["name"]: p for p in plans}
    rows = []
    for p in plans:
        if p["name"].endswith(OVERLAP) and p["name"][:-len(OVERLAP)] in by_name:
            plain = by_name[p["name"][:-len(OVERLAP)]]
            sync = plain["terms"]["sync"]["measured_s"]
            rows.append({"kind": "overlap", "plan": plain["name"],
                         "plain_s": plain["measured_s"], "overlapped_s": p["measured_s"],
                         "plain_sync_s": sync,
                         "hidden_s": plain["measured_s"] - p["measured_s"],
                         "predicted_plain_s": plain["predicted_s"],
                         "predicted_overlapped_s": p["predicted_s"],
                         "target_met": p["measured_s"]
                         <= plain["measured_s"] - OVERLAP_HIDDEN * sync})
    pair = ((by_name.get(OURS), by_name.get(FLAT_OURS)) if FLAT_OURS in by_name else
            (by_name.get(INTERLEAVED_OURS), by_name.get(OURS)))
    interleaved, flat = pair
    if interleaved is not None and flat is not None:
        rows.append({"kind": "interleave", "interleaved": interleaved["name"],
                     "flat": flat["name"], "interleaved_s": interleaved["measured_s"],
                     "flat_s": flat["measured_s"],
                     "predicted_interleaved_s": interleaved["predicted_s"],
                     "predicted_flat_s": flat["predicted_s"],
                     "interleaved_error": interleaved["error"],
                     "planner_chose_interleaving": interleaved["name"] == OURS,
                     "target_met": (interleaved["measured_s"] < flat["measured_s"]
                                    and abs(interleaved["error"]) <= INTERLEAVE_ERROR)})
    return rows


def plan_summary(name: str, predicted: dict, wall_per_rank: list[list[float]],
                 marks_per_iteration: list[list[dict]], stage_compute: list[dict],
                 num_microbatches: list[int]) -> dict:
    """One plan's predicted vs measured figures.

    ``predicted``: the cost model's iteration/pipeline/sync/optimizer seconds and its stages
    (``{"pipeline", "compute_s", "p2p_s"}`` each); ``wall_per_rank``: train_step seconds per rank
    per timed iteration; ``marks_per_iteration``: per iteration, every rank's phase ends;
    ``stage_compute``: per stage (same order as the predicted stages) the measured median
    forward + backward seconds per micro-batch; ``num_microbatches``: per pipeline.
    """
    measured = statistics.median(iteration_times(wall_per_rank))
    phases = median_phases([phase_times(m) for m in marks_per_iteration])
    repriced = []
    for p, m in enumerate(num_microbatches):
        stages = [dict(s, compute_s=c["compute_s"]) for s, c in
                  zip(predicted["stages"], stage_compute) if s["pipeline"] == p]
        repriced.append(repriced_pipeline_s(stages, m))
    summary = {
        "name": name, "predicted_s": predicted["iteration_time_s"], "measured_s": measured,
        "error": relative_error(predicted["iteration_time_s"], measured),
        "terms": {
            "pipeline": {"predicted_s": predicted["pipeline_time_s"],
                         "repriced_s": max(repriced),
                         "measured_s": phases["schedule"]},
            "sync": {"predicted_s": predicted["grad_sync_s"], "measured_s": phases["sync"]},
            "norm": {"predicted_s": 0.0, "measured_s": phases["norm"]},
            "optimizer": {"predicted_s": predicted["optimizer_s"],
                          "measured_s": phases["optimizer"]}},
        "stages": [dict(s, measured_compute_s=c["compute_s"],
                        **{f"measured_{k}": v for k, v in c.items() if k != "compute_s"})
                   for s, c in zip(predicted["stages"], stage_compute)],
        "iterations_s": iteration_times(wall_per_rank)}
    summary["error_s_by_term"] = error_contributions(summary)
    # The cost model's terms fed the in-run compute instead of the profile's: what is left is
    # the model's own error (schedule, P2P, sync, optimizer), the profile's taken out.
    summary["error_with_in_run_compute"] = relative_error(
        summary["predicted_s"] - summary["error_s_by_term"]["compute"], measured)
    return summary


def error_contributions(summary: dict) -> dict[str, float]:
    """The iteration-time error (predicted - measured seconds) split by term; the parts add up to
    the whole. compute: the profile vs the in-run compute; schedule: the 1F1B formula (bubble, P2P
    overlap) vs the measured schedule; sync, norm (unpriced), optimizer: predicted vs measured
    phase; rest: what the phases do not cover (the slowest rank's iteration vs the latest phase
    ends)."""
    t = summary["terms"]
    pipe = t["pipeline"]
    parts = {"compute": pipe["predicted_s"] - pipe["repriced_s"],
             "schedule": pipe["repriced_s"] - pipe["measured_s"],
             "sync": t["sync"]["predicted_s"] - t["sync"]["measured_s"],
             "norm": t["norm"]["predicted_s"] - t["norm"]["measured_s"],
             "optimizer": t["optimizer"]["predicted_s"] - t["optimizer"]["measured_s"]}
    parts["rest"] = summary["predicted_s"] - summary["measured_s"] - sum(parts.values())
    return parts


def predicted_figures(cost) -> dict:
    """What plan_summary needs of a cost_model.PlanCost."""
    return {"iteration_time_s": cost.iteration_time_s, "pipeline_time_s": cost.pipeline_time_s,
            "grad_sync_s": cost.grad_sync_s, "optimizer_s": cost.optimizer_s,
            "stages": [{"pipeline": s.pipeline, "stage": s.stage, "gpu": s.gpu,
                        "layers": list(s.layers), "compute_s": s.time_s, "p2p_s": s.p2p_s}
                       for s in cost.stages]}


# ---- one emulated GPU (runs inside its namespace and cgroup) -------------------------------------

def store_barrier(store, key: str, world: int, busy=None) -> None:
    """Wait until all ``world`` processes arrived at ``key``, calling ``busy()`` meanwhile."""
    if store.add(key, 1) == world:
        store.set(f"{key}/go", "1")
    while busy is not None and not store.check([f"{key}/go"]):
        busy()
    store.wait([f"{key}/go"])


def idle_gpu_load(plan):
    """A few milliseconds of a transformer layer's kind of work (its MLP's GEMMs on one
    micro-batch), run in a loop by an emulated GPU that a plan leaves idle. On one machine an idle
    process lets its neighbours run faster (a layer's CPU time on EMU-FAST: 19.6 ms with the other
    GPUs idle, 21-22 ms beside busy ones, as in the profile); a real idle GPU gives its neighbours
    nothing, so an emulated one stays busy inside its quota."""
    import torch

    model = plan.model
    x = torch.randn(plan.seq_length * plan.micro_batch_size, model.hidden_size)
    w = torch.randn(model.hidden_size, model.ffn_hidden_size) / model.hidden_size ** 0.5

    def busy() -> None:
        torch.relu(x @ w) @ w.T
    return busy


def worker(args) -> None:
    silence_known_megatron_warnings()
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import schedules

    import megatron_autohet.runtime.trainer as trainer_module
    from megatron_autohet.data.batches import DataOptions, build_global_batches
    from megatron_autohet.plan import load_plan
    from megatron_autohet.runtime.cpu_mode import cpu_mode_required, enable_cpu_mode
    from megatron_autohet.runtime.optimizer import OptimizerSettings
    from megatron_autohet.runtime.trainer import HeteroTrainer

    torch.set_num_threads(1)
    if cpu_mode_required():
        enable_cpu_mode()
    device_rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node, local = args.node, int(os.environ["LOCAL_RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=device_rank == 0, timeout=timedelta(seconds=args.timeout))
    names = json.loads(Path(args.plans).read_text())
    plans = {n: load_plan(Path(args.plan_dir) / f"{i}.yaml") for i, n in enumerate(names)}
    total = args.rounds * (args.warmup + args.iters)
    first = plans[names[0]]
    data = build_global_batches(DataOptions(seq_length=first.seq_length,
                                            global_batch_size=first.global_batch_size,
                                            num_iterations=total, seed=SEED,
                                            data_dir=args.data_dir), first.model.vocab_size)
    batches = [data.batch(i).tensors() for i in range(total)]   # read before any clock starts
    settings = OptimizerSettings(lr=1e-4, clip_grad=1.0, lr_decay_style="constant")

    # Stamps and compute sums of the current iteration (wrapped around the runtime's calls).
    stamps: dict[str, float] = {}
    compute = {"fwd": 0.0, "bwd": 0.0, "cpu": 0.0}
    clock = {"start": 0.0}

    def stamped(fn, phase):
        def wrapper(*a, **k):
            out = fn(*a, **k)
            stamps[phase] = time.perf_counter() - clock["start"]
            return out
        return wrapper

    # Clipping is part of the norm phase; the trainer clips its master weights' gradients with
    # this function (the runtime's GradSync has no clip of its own).
    trainer_module.clip_grad_by_total_norm_fp32 = stamped(
        trainer_module.clip_grad_by_total_norm_fp32, "norm")

    def summed(fn, kind):
        def wrapper(*a, **k):
            t, cpu = time.perf_counter(), time.thread_time()
            out = fn(*a, **k)
            compute[kind] += time.perf_counter() - t
            compute["cpu"] += time.thread_time() - cpu
            return out
        return wrapper

    trainer_module.run_schedule = stamped(trainer_module.run_schedule, "schedule")
    schedules.forward_step = summed(schedules.forward_step, "fwd")
    schedules.backward_step = summed(schedules.backward_step, "bwd")

    results = {n: {"wall_s": [], "marks": [], "compute_s": [], "compute_cpu_s": [],
                   "plan_rank": None}
               for n in names}
    for r in range(args.rounds):
        step = r * (args.warmup + args.iters)      # every plan trains the same batches
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            plan = plans[name]
            ranks = [(x.node, x.local_rank) for x in plan.ranks]
            mine = ranks.index((node, local)) if (node, local) in ranks else None
            if mine is not None:
                results[name]["plan_rank"] = mine
                dist.init_process_group("gloo", store=dist.PrefixStore(f"{r}/{name}", store),
                                        rank=mine, world_size=len(ranks))
                trainer = HeteroTrainer(plan, rank=mine, seed=SEED, optimizer=settings,
                                        overlap_grad_reduce=plan.overlap_grad_reduce)
                grad_sync = trainer.grad_sync
                grad_sync.sync = stamped(grad_sync.sync, "sync")
                trainer._global_loss_and_grad_norm = stamped(trainer._global_loss_and_grad_norm,
                                                             "norm")
                trainer.optimizer.step = stamped(trainer.optimizer.step, "optimizer")
                m = next(p.num_microbatches for p in plan.pipelines for s in p.stages
                         if mine in s.ranks)
                for i in range(args.warmup + args.iters):
                    dist.barrier()
                    stamps.clear()
                    compute.update(fwd=0.0, bwd=0.0, cpu=0.0)
                    clock["start"] = time.perf_counter()
                    trainer.train_step(batches[step + i])
                    wall = time.perf_counter() - clock["start"]
                    if i >= args.warmup:
                        results[name]["wall_s"].append(wall)
                        results[name]["marks"].append(dict(stamps))
                        results[name]["compute_s"].append((compute["fwd"] + compute["bwd"]) / m)
                        results[name]["compute_cpu_s"].append(compute["cpu"] / m)
                dist.destroy_process_group()
                del trainer
                gc.collect()    # the plan's garbage, or the next plan's iterations collect it
            store_barrier(store, f"done/{r}/{name}", world,
                          busy=idle_gpu_load(plan) if mine is None else None)
    Path(args.result).write_text(json.dumps({"node": node, "local_rank": local,
                                             "plans": results}))
    store_barrier(store, "exit", world)      # rank 0 hosts the store: it leaves last


# ---- the driver ----------------------------------------------------------------------------------

def progress(message: str) -> None:
    print(f"> {time.strftime('%H:%M:%S')} {message}", flush=True)


def mean_profile(profiles: list):
    """One profile from several measurements of the same keys (the emulated GPUs of one type):
    per entry and part, the mean forward and backward times; the rest is the first's."""
    from dataclasses import replace

    from megatron_autohet.profiling.profile import Profile

    out = Profile(profiles[0].model, precision=profiles[0].precision,
                  attention=profiles[0].attention)
    keys = dict.fromkeys(k for p in profiles for k in p.entries)
    for key in keys:
        copies = [p.entries[key] for p in profiles if key in p.entries]
        parts = {}
        for part in ("layer", "embedding", "output"):
            ops = [getattr(e, part) for e in copies]
            parts[part] = replace(ops[0], forward_s=statistics.fmean(o.forward_s for o in ops),
                                  backward_s=statistics.fmean(o.backward_s for o in ops))
        out.add(replace(copies[0], **parts))
    return out


def profile_fleet(cluster: emu.EmulatedCluster, placements, model_path: str, tmp: Path,
                  micro_batch_size: int, iters: int, timeout: float):
    """`autohet profile` on every emulated GPU at once, each inside its quota and on its CPU, as
    they will train (measuring one GPU per type, the CPUs less busy than in training, gave
    faster layers than the run saw); a type's figures are the mean over its GPUs. ``iters`` is
    the slowest type's count: a type k times faster runs k times as many, so every GPU profiles
    for about the same time and each is measured beside busy neighbours throughout, as in
    training (with one count for all, the fast GPUs finished first and the slowest type was
    measured on an emptier machine)."""
    from megatron_autohet.profiling.profile import Profile

    slowest = min(cluster.fleet.cpu_share.values())
    procs, outputs = [], []
    for p in placements:
        out = tmp / f"profile-rank{p.rank}.yaml"
        scale = cluster.fleet.cpu_share[p.gpu] / slowest
        cmd = [sys.executable, "-m", "megatron_autohet.cli.main", "profile", "--model", model_path,
               "--as-gpu", p.gpu, "--gpu-catalog", str(emu.DEFAULT_CATALOG), "--tp", "1",
               "--micro-batch-size", str(micro_batch_size), "--warmup", str(round(3 * scale)),
               "--iters", str(round(iters * scale)), "-o", str(out)]
        env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
        procs.append(cluster.spawn(p, cmd, env, tmp / f"profile-rank{p.rank}.log"))
        outputs.append(out)
    if emu.wait_all(procs, timeout):
        logs = "\n".join((tmp / f"profile-rank{p.rank}.log").read_text()[-2000:]
                         for p in placements)
        raise SystemExit(f"profiling failed:\n{logs}")
    return mean_profile([Profile.load(out) for out in outputs])


def variant_plans(plans: list[tuple], costs: dict, fleet, model, profile, gbs: int,
                  args) -> list[tuple]:
    """``--variants``' twins (module doc, step 5) of ``plans`` ((name, plan), ``costs`` by
    name): an overlap twin of each one-chunk plan with a predicted sync, then our plan's other
    choice of virtual stages."""
    from megatron_autohet.planner.interleave import interleavable, interleaved
    from megatron_autohet.planner.search import search

    out = []
    for name, plan in plans:
        if costs[name].grad_sync_s > 0 and not any(p.interleaved for p in plan.pipelines):
            twin = copy.deepcopy(plan)
            twin.overlap_grad_reduce, twin.predicted = True, {}
            out.append((name + OVERLAP, twin))
    ours = dict(plans)[OURS]
    if any(p.interleaved for p in ours.pipelines):
        flat = search(fleet.cluster, model, profile, gbs, args.micro_batch_size,
                      activation_recompute=False, time_limit_s=args.time_limit,
                      progress=False, virtual_stages=False).plan
        out.append((FLAT_OURS, flat))
    elif any(interleavable(p, 2) for p in ours.pipelines):
        twin = copy.deepcopy(ours)
        twin.pipelines = [interleaved(p, 2) if interleavable(p, 2) else p
                          for p in twin.pipelines]
        twin.predicted = {}
        twin.validate()
        out.append((INTERLEAVED_OURS, twin))
    return out


def run_fleet(fleet_path: str, args, tmp: Path) -> dict:
    from megatron_autohet.cost_model import annotate_plan, evaluate_plan
    from megatron_autohet.planner.compare import compare
    from megatron_autohet.spec import load_model

    fleet = emu.load_fleet(fleet_path)
    model = load_model(args.model)
    placements = emu.place_ranks(fleet, prefix=args.prefix)
    work = tmp / fleet.cluster.name
    work.mkdir()
    load_before = os.getloadavg()[0]
    with emu.EmulatedCluster(fleet, args.prefix) as cluster:
        progress(f"{fleet.cluster.name}: profiling {', '.join(fleet.cpu_share)} in their quotas")
        profile = profile_fleet(cluster, placements, args.model, work, args.micro_batch_size,
                                args.profile_iters, args.timeout)
        profile.save(work / "profile.yaml")
        gbs = args.micro_batch_size * args.microbatches
        result = compare(fleet.cluster, model, profile, gbs, args.micro_batch_size,
                         activation_recompute=False, time_limit_s=args.time_limit,
                         progress=False)
        # on a fleet across zones the zone-oblivious and the best single-zone plan too
        others = result.baselines + result.zone_plans
        plans = [(OURS, result.plan)] + [(b.name, b.plan) for b in others if b.plan]
        costs = {}
        for name, plan in plans:
            costs[name] = evaluate_plan(plan, fleet.cluster, profile)
        if args.variants:
            twins = variant_plans(plans, costs, fleet, model, profile, gbs, args)
            for name, plan in twins:
                costs[name] = evaluate_plan(plan, fleet.cluster, profile)
            plans += twins
        for i, (name, plan) in enumerate(plans):
            annotate_plan(plan, costs[name]).save(work / f"{i}.yaml")
        (work / "plans.json").write_text(json.dumps([n for n, _ in plans]))
        progress(f"{fleet.cluster.name}: training {len(plans)} plans, {args.rounds} rounds of "
                 f"{args.warmup} + {args.iters} iterations each")
        cmd = [sys.executable, __file__, "--worker", "--plans", str(work / "plans.json"),
               "--plan-dir", str(work), "--data-dir", str(tmp / "data"),
               "--rounds", str(args.rounds), "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--timeout", str(args.timeout)]
        procs = []
        for p in placements:
            env = {**emu.rank_env(p, placements[0], PORT), "PYTHONPATH": str(ROOT)}
            procs.append(cluster.spawn(p, cmd + ["--node", p.node, "--result",
                                                 str(work / f"rank{p.rank}.json")],
                                       env, work / f"rank{p.rank}.log"))
        if emu.wait_all(procs, args.timeout):
            logs = "\n".join(f"---- rank {p.rank}\n" + (work / f"rank{p.rank}.log").read_text(
                errors="replace")[-2500:] for p in placements)
            raise SystemExit(f"{fleet.cluster.name}: training failed:\n{logs}")
        between = emu.zone_link(fleet, args.prefix)
        zone_link = None if between is None else {
            "mbit": between.rate_mbit, "latency_ms": between.delay_ms,
            "latency_emulated": cluster.zone_delay}
    load_after = os.getloadavg()[0]
    per_device = [json.loads((work / f"rank{p.rank}.json").read_text()) for p in placements]
    summaries = []
    for name, plan in plans:
        members = sorted((d["plans"][name]["plan_rank"], d["plans"][name]) for d in per_device
                         if d["plans"][name]["plan_rank"] is not None)
        ranks = [r for _, r in members]
        cost = costs[name]
        # per predicted stage: the median in-run compute of its first rank
        # per predicted stage: its first rank's median in-run compute per micro-batch, and the
        # CPU time of it (CPU / wall: the share of a core the stage really got)
        firsts = [ranks[plan.pipelines[s.pipeline].stages[s.stage].ranks[0]] for s in cost.stages]
        stage_compute = [{"compute_s": statistics.median(r["compute_s"]),
                          "compute_cpu_s": statistics.median(r["compute_cpu_s"])} for r in firsts]
        marks = [list(col) for col in zip(*(r["marks"] for r in ranks))]
        summary = plan_summary(name, predicted_figures(cost), [r["wall_s"] for r in ranks],
                               marks, stage_compute, [p.num_microbatches for p in plan.pipelines])
        summary["layout"] = next((b.note for b in others if b.name == name),
                                 f"{len(plan.pipelines)} pipelines"
                                 + (f", v={max(p.virtual_stages for p in plan.pipelines)}"
                                    if any(p.interleaved for p in plan.pipelines) else ""))
        summary["plan"] = plan.to_dict()
        summary["ranks"] = ranks            # raw: per plan rank, its timings per iteration
        summaries.append(summary)
    return {"fleet": fleet.cluster.name, "file": fleet_path,
            "cpu_share": fleet.cpu_share, "link_mbit": {n.name: fleet.link_mbit(n.name)
                                                        for n in fleet.cluster.nodes},
            "zone_link": zone_link,
            "plans": summaries, "speedups": speedup_rows(summaries),
            "variants": variant_rows(summaries),
            "effective_share": effective_shares(summaries),
            "load_average_1min": {"before": load_before, "after": load_after}}


def effective_shares(plans: list[dict]) -> dict[str, float]:
    """Per GPU type, the median over its stages in every plan of compute CPU time / wall time:
    the share of a core it really got (the quota is a ceiling; other load takes from it)."""
    ratios: dict[str, list[float]] = {}
    for p in plans:
        for s in p["stages"]:
            ratios.setdefault(s["gpu"], []).append(s["measured_compute_cpu_s"]
                                                   / s["measured_compute_s"])
    return {gpu: statistics.median(r) for gpu, r in ratios.items()}


def largest_term(plan: dict, count: int = 2) -> str:
    parts = sorted(plan["error_s_by_term"].items(), key=lambda kv: -abs(kv[1]))[:count]
    return ", ".join(f"{k} {v:+.3f}" for k, v in parts)


def print_fleet(r: dict) -> None:
    got = ", ".join(f"{g} {v:.2f}" for g, v in r["effective_share"].items())
    print(f"\n== {r['fleet']}: CPU shares {r['cpu_share']} (got in the run: {got}), NICs "
          f"{r['link_mbit']} Mbit/s; load average {r['load_average_1min']['before']:.2f} -> "
          f"{r['load_average_1min']['after']:.2f}")
    print("seconds; in-run: the error with the in-run compute in place of the profile's; "
          "pipeline p/r/m = predicted / repriced with the in-run compute / measured; p/m = "
          "predicted / measured; norm: loss + grad-norm all-reduce and clipping (not in the "
          "cost model)")
    print(f"{'plan':<27} {'layout':<15} {'pred s':>7} {'meas s':>7} {'error':>7} "
          f"{'in-run':>7}  {'pipeline p/r/m':>17} {'sync p/m':>11} {'norm m':>7} "
          f"{'opt p/m':>11}  largest error terms")
    for p in r["plans"]:
        t = p["terms"]
        print(f"{p['name']:<27} {p['layout']:<15} {p['predicted_s']:>7.3f} {p['measured_s']:>7.3f} "
              f"{p['error']:>+7.1%} {p['error_with_in_run_compute']:>+7.1%}  "
              f"{t['pipeline']['predicted_s']:>5.3f}/"
              f"{t['pipeline']['repriced_s']:.3f}/{t['pipeline']['measured_s']:.3f} "
              f"{t['sync']['predicted_s']:>5.3f}/{t['sync']['measured_s']:.3f} "
              f"{t['norm']['measured_s']:>7.3f} {t['optimizer']['predicted_s']:>5.3f}/"
              f"{t['optimizer']['measured_s']:.3f}  {largest_term(p)}")
    print(f"{'our speedup over':<26} {'predicted':>10} {'measured':>10} {'diff':>8}")
    for s in r["speedups"]:
        print(f"{s['baseline']:<26} {s['predicted_speedup']:>9.2f}x {s['measured_speedup']:>9.2f}x "
              f"{s['speedup_error']:>+8.1%}")
    for v in r.get("variants", ()):
        met = "met" if v["target_met"] else "NOT met"
        if v["kind"] == "overlap":
            print(f"overlap, {v['plan']}: measured {v['plain_s']:.3f} -> {v['overlapped_s']:.3f} "
                  f"s (predicted {v['predicted_plain_s']:.3f} -> "
                  f"{v['predicted_overlapped_s']:.3f}), {v['hidden_s']:.3f} s hidden of "
                  f"{v['plain_sync_s']:.3f} s measured sync (target >= {OVERLAP_HIDDEN:.0%}: "
                  f"{met})")
        else:
            chose = ("the planner chose it" if v["planner_chose_interleaving"]
                     else "forced: the planner chose v=1")
            print(f"interleaving ({chose}): {v['interleaved']} {v['interleaved_s']:.3f} s "
                  f"measured against {v['flat']} {v['flat_s']:.3f} s, predicted "
                  f"{v['predicted_interleaved_s']:.3f} ({v['interleaved_error']:+.1%}; target "
                  f"faster and within {INTERLEAVE_ERROR:.0%}: {met})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fleets", nargs="+", default=DEFAULT_FLEETS, metavar="C.yaml")
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="M.yaml")
    parser.add_argument("--micro-batch-size", type=int, default=4,
                        help="default 4: a stage's forward or backward of one micro-batch is one "
                             "burst of CPU between waits, and a short burst outruns its quota "
                             "(scripts/emulate_cluster.py); with 2, 1-layer EMU-MID stages ran "
                             "26-39%% faster than profiled, with 4 3%% slower to 25%% faster")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="micro-batches per global batch (default 8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=4, help="timed iterations per plan and round")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed iterations per plan and round")
    parser.add_argument("--profile-iters", type=int, default=15,
                        help="timed profile iterations of the slowest type (a type k times "
                             "faster runs k times as many)")
    parser.add_argument("--time-limit", type=float, default=20.0, help="planner search budget")
    parser.add_argument("--timeout", type=float, default=1500.0)
    parser.add_argument("--variants", action="store_true",
                        help="also train each syncing plan with its gradient reduce overlapped "
                             "and our plan with the other choice of virtual stages, paired in "
                             "the same rounds (the module doc's step 5)")
    parser.add_argument("--prefix", default="ahbench")
    parser.add_argument("--json", default=str(ROOT / "bench-out" / "bench_emulated.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--node", help=argparse.SUPPRESS)
    parser.add_argument("--plans", help=argparse.SUPPRESS)
    parser.add_argument("--plan-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    emu.require_root()
    emu.raise_on_sigterm()
    tmp = Path(tempfile.mkdtemp(prefix="bench-emulated-"))
    try:
        from megatron_autohet.data.batches import DataOptions, resolve_data_path
        resolve_data_path(DataOptions(64, 1, 1, data_dir=str(tmp / "data")))
        fleets = []
        for path in args.fleets:
            fleets.append(run_fleet(path, args, tmp))
            print_fleet(fleets[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json({"model": args.model, "micro_batch_size": args.micro_batch_size,
                "microbatches": args.microbatches, "rounds": args.rounds, "iters": args.iters,
                "warmup": args.warmup, "fleets": fleets}, args.json)


if __name__ == "__main__":
    main()
