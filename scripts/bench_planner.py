#!/usr/bin/env python
"""Planner benchmark: solve time vs cluster size, plan quality vs baselines and vs brute force.

    python scripts/bench_planner.py [--json bench-out/bench_planner.json] [--quick]
    python scripts/bench_planner.py --optimality-only 300     # table 5 alone, 300 seeds each
    python scripts/bench_planner.py --family-only [--quick]   # table 8 alone

Seven tables, all predictions from the same cost model (megatron_autohet/cost_model.py):
1. solve time of make_plan on generated fleets of 8-4096 GPUs over three GPU types (8-GPU nodes;
   the 8-GPU fleet uses 4/2/2-GPU nodes; 4096 GPUs also over four types) for GPT-3 1.3B and
   LLaMA-2 7B, with the search's work (SCIP nodes) and how it ended (the work is the
   deterministic figure, the times depend on the machine and its load), and the plan's
   efficiency: its tokens/s over the fleet's ideal (cost_model.fleet_ideal_tokens_per_s, the
   sum of every GPU's lone forward+backward token rate for the whole model);
   Then the same for every bundled fleet (configs/clusters/) with every bundled model
   (configs/models/), global batch 512, micro-batch 1;
2. re-plan time (planner/replan.py) of the 1024-GPU plans: fleet unchanged, and one node lost
   (the first A100 node, or the last H20 node), with the bytes the recovery would move and how
   its search ended; then of plans made with the cost objective on priced fleets (per node and
   per GPU, a floor kept and one out of reach), with their USD per million tokens before and
   after;
3. predicted iteration time, efficiency and speedup over the baselines on the bundled 3-type
   fleets;
4. gap to the exhaustive optimum on small clusters (<= 16 GPUs, 8-layer GPT-3 1.3B);
5. the gap's distribution over seeded random small fleets (testing/random_fleets.py; more seeds than
   tests/planner/test_planner_optimality.py runs), general, memory-bound, odd-count ones (2-4
   types of 1 or 3 GPUs, 7-13 layers) and general ones over two or three zones, with each
   search's CPU seconds;
6. `autohet compare` (search + baselines) time on 2048 GPUs, and how its search ended;
7. the cost objective: USD per million tokens of the fastest and of the cheapest plan on priced
   fleets (spot prices in PRICES), the GPUs the cheapest leaves idle, and how its search ended;
8. the CPU budget over a family of fleets (FAMILY: four three-type mixes and one of four types,
   8-GPU nodes, 25 GB/s) at 512-4096 GPUs with GPT-3 1.3B and LLaMA-2 7B: each plan's CPU
   seconds (the process's, children included) and how its search ended, `autohet compare` at
   2048 GPUs, the re-plan of the 1024-GPU plans after losing one node (the first the plan uses,
   and the fleet's last; its work column counts the plans it judged, a search's SCIP nodes), then
   the worst case of each against its target (TARGETS_CPU_S; a re-plan's search ends on its small
   work budget by design, so it never counts as complete).
   Every search of this table has a safety net of FAMILY_SAFETY_NET_S, so the work budgets alone
   end them at any load. The plans train in bf16: the V100s and T4s of the V100/T4/A100 mix
   cannot (spec/cluster.py trainable_fleet), so its plans use its A100s and leave those idle.
   ``--family-only`` runs this table alone; with ``--quick`` 1024 GPUs and GPT-3 1.3B only, the
   re-plan after losing the first node the plan uses.
Writes JSON to --json (default bench-out/, gitignored by the repository's bench-out/ rule).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

from _bench import write_json

from megatron_autohet.cost_model import fleet_ideal_tokens_per_s
from megatron_autohet.errors import ConfigError
from megatron_autohet.planner import compare, search
from megatron_autohet.planner.cost_search import FloorNotMet
from megatron_autohet.testing.exhaustive import exhaustive_optimum, exhaustive_search
from megatron_autohet.testing.random_fleets import (memory_bound_case, odd_case, random_case,
                                                     zoned_case)
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.planner.replan import REPLAN_WORK_BUDGET, replan
from megatron_autohet.spec import load_cluster, load_model
from megatron_autohet.spec.cluster import Cluster, cluster_from_dict

ROOT = Path(__file__).resolve().parent.parent
TYPES = ("A100-80GB", "H800", "H20")
# USD per GPU-hour (spot-like figures) for the priced fleets of table 6.
PRICES = {"A100-80GB": 1.60, "H800": 2.90, "H20": 1.20, "V100-32GB": 0.90}
# The reachable throughput floor of the cost-objective re-plans (table 2), of the fleet's
# fastest plan's.
COST_REPLAN_FLOOR = 0.6
# Table 8's family of fleets: GPU types in fleet()'s split order (three types ~40/30/30).
FAMILY = {"A100/H800/H20": ("A100-80GB", "H800", "H20"),
          "A100/H800/L40S": ("A100-80GB", "H800", "L40S"),
          "H100/A10G/L4": ("H100", "A10G", "L4"),
          "V100/T4/A100": ("V100-32GB", "T4", "A100-80GB"),
          "A100/H800/H20/L40S": ("A100-80GB", "H800", "H20", "L40S")}
# The CPU seconds the planner is held to, worst over the family, each search complete.
TARGETS_CPU_S = {"plan 1024 GPUs": 5.0, "plan 4096 GPUs": 30.0, "compare 2048 GPUs": 15.0,
                 "re-plan 1024 GPUs, one node lost": 1.0}
# Table 8's wall-clock safety net per search: far above what any load makes of its CPU seconds.
FAMILY_SAFETY_NET_S = 3600.0


def fleet(gpus: int, types: tuple[str, ...] = TYPES, priced: bool = False) -> Cluster:
    """A fleet of 8-GPU nodes: three types split ~40/30/30 (A100/H800/H20; 4/2/2-GPU nodes for
    8 GPUs), or four types split evenly (the last type gets the remainder)."""
    if gpus == 8:
        sizes = list(zip(types, (4, 2, 2)))
        nodes = [{"name": t.lower(), "gpu": t, "gpus": n} for t, n in sizes]
    else:
        count = gpus // 8
        if len(types) == 3:
            split = (count - 2 * (count * 3 // 10), count * 3 // 10, count * 3 // 10)
        else:
            split = tuple([count // len(types)] * (len(types) - 1)
                          + [count - (len(types) - 1) * (count // len(types))])
        nodes = [{"name": t.lower(), "gpu": t, "gpus": 8, "count": c}
                 for t, c in zip(types, split) if c]
    if priced:
        for node in nodes:
            node["spot_price"] = PRICES[node["gpu"]]
    return cluster_from_dict({"name": f"fleet-{gpus}-{len(types)}types",
                              "inter_node_bandwidth_gbs": 25, "nodes": nodes})


def cpu_seconds() -> float:
    """The process's CPU time, user and system, its finished children's included."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def small(name: str, nodes: list[tuple[str, int]]) -> Cluster:
    return cluster_from_dict({"name": name, "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": f"n{i}", "gpu": g, "gpus": n} for i, (g, n) in enumerate(nodes)]})


def efficiency(cluster: Cluster, model, tokens_per_s: float, micro_batch_size: int) -> float:
    """A plan's tokens/s over the fleet's ideal (module doc), on the analytic estimates."""
    profile = resolve_profile(cluster, model, None, micro_batch_size, model.seq_length)
    return tokens_per_s / fleet_ideal_tokens_per_s(cluster, profile, model, micro_batch_size,
                                                   model.seq_length)


def gap_distribution(make_case, seeds) -> dict:
    """The planner's gap to the exhaustive optimum on each seed's case (the cases no plan fits
    are counted apart: both searches must refuse them), after each one's warm-up pass and on
    the closed form (Case.closed_form_s)."""
    gaps, infeasible, disagreements, seconds, closed = [], 0, [], [0.0, 0.0], []
    for seed in seeds:
        case = make_case(seed)
        args = (case.cluster, case.model, None, case.global_batch_size, case.micro_batch_size)
        start = time.process_time()
        try:
            before_pass, best = exhaustive_optimum(*args, **case.space())
        except ConfigError:
            best = None
        seconds[1] += time.process_time() - start
        start = time.process_time()
        try:
            ours = search(*args, progress=False, virtual_stages=False, **case.space())
        except ConfigError:
            ours = None
        seconds[0] += time.process_time() - start
        if best is None or ours is None:
            infeasible += 1
            if (best is None) != (ours is None):
                disagreements.append(seed)
            continue
        gaps.append((ours.cost.iteration_time_s / best.cost.iteration_time_s - 1, seed))
        optimum = before_pass.cost.iteration_time_s
        closed.append((ours.cost.iteration_time_s / optimum - 1,
                       case.closed_form_s(ours.plan) / optimum - 1))
    gaps.sort()
    values = [g for g, _ in gaps]

    def quantile(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    return {"cases": len(values), "no_plan_fits": infeasible,
            "feasibility_disagrees": disagreements,
            "max_gap": values[-1] if values else None, "worst_seed": gaps[-1][1] if gaps else None,
            "median_gap": quantile(0.5), "p90_gap": quantile(0.9), "p99_gap": quantile(0.99),
            "over_1_percent": sum(g > 0.01 for g in values),
            "below_zero": sum(g < -1e-9 for g in values),
            # against the closed-form optimum (standard warm-ups, what the brute force
            # enumerates): our plan after its warm-up pass, and our plan's own closed form,
            # which a true brute force never beats
            "closed_form_max_gap": max((g for g, _ in closed), default=None),
            "closed_form_over_1_percent": sum(g > 0.01 for g, _ in closed),
            "closed_form_below_zero": sum(c < -1e-9 for _, c in closed),
            "planner_s": seconds[0], "exhaustive_s": seconds[1]}


def random_gap_table(result: dict, args) -> None:
    """Table 5: the gap's distribution over each kind of seeded random small fleet."""
    print("\n== gap to the exhaustive optimum on seeded random small fleets "
          "(testing/random_fleets.py)")
    print(f"{'fleets':>16} {'cases':>5} {'no fit':>6} {'median':>7} {'p90':>7} {'p99':>7} "
          f"{'max':>7} {'>1%':>4} {'<0':>3} {'worst':>5} {'ours_cpu':>8} {'brute_cpu':>9}")
    for label, make_case, seeds in (
            ("random", random_case, range(40 if args.quick else 300)),
            ("memory-bound", memory_bound_case, range(40 if args.quick else 200)),
            ("odd counts", odd_case, range(40 if args.quick else 300)),
            ("across zones", zoned_case, range(40 if args.quick else 300))):
        if args.optimality_only is not None:
            seeds = range(args.optimality_only)
        row = {"fleets": label, "seeds": [seeds.start, seeds.stop],
               **gap_distribution(make_case, seeds)}
        result["random_gaps"].append(row)
        print(f"{label:>16} {row['cases']:>5} {row['no_plan_fits']:>6} "
              f"{100 * row['median_gap']:>6.2f}% {100 * row['p90_gap']:>6.2f}% "
              f"{100 * row['p99_gap']:>6.2f}% {100 * row['max_gap']:>6.2f}% "
              f"{row['over_1_percent']:>4} {row['below_zero']:>3} {row['worst_seed']:>5} "
              f"{row['planner_s']:>8.1f} {row['exhaustive_s']:>9.1f}")
        print(f"{'':>16} against the closed-form optimum: max "
              f"{100 * (row['closed_form_max_gap'] or 0):.2f}%, "
              f"{row['closed_form_over_1_percent']} over 1%; our closed form below it: "
              f"{row['closed_form_below_zero']}")
        if row["feasibility_disagrees"]:
            print(f"{'':>16} seeds where only one search found a plan: "
                  f"{row['feasibility_disagrees']}")


def bundled_table(result: dict, args) -> None:
    """Table 1, second part: every bundled fleet with every bundled model (global batch 512,
    micro-batch 1; --quick: the three-type fleets with two models)."""
    print("\n== solve time on the bundled fleets x bundled models (global batch 512, "
          f"micro-batch 1); load average {os.getloadavg()[0]:.1f}")
    print(f"{'cluster':>14} {'model':>11} {'wall_s':>7} {'cpu_s':>6} {'work':>5} {'ended':>11} "
          f"{'iter_s':>9}")
    clusters = sorted((ROOT / "configs/clusters").glob("*.yaml"))
    names = sorted((ROOT / "configs/models").glob("*.yaml"))
    if args.quick:
        clusters = [ROOT / f"configs/clusters/{c}.yaml" for c in ("a100-h800-h20", "a100-v100-t4")]
        names = [ROOT / f"configs/models/{m}.yaml" for m in ("gpt3-1.3b", "gpt3-6.7b")]
    for path in clusters:
        cluster = load_cluster(path)
        for model_path in names:
            model = load_model(model_path)
            start, cpu = time.perf_counter(), time.process_time()
            try:
                cand = search(cluster, model, None, 512, 1, progress=False)
            except ConfigError:
                cand = None         # no plan fits in memory (one GPU of 80 GB and a 13B model)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            row = {"cluster": path.stem, "model": model.name, "solve_s": elapsed, "cpu_s": cpu,
                   "work": cand.work if cand else None,
                   "stopped_by": cand.stopped_by if cand else "no plan fits",
                   "iteration_time_s": cand.cost.iteration_time_s if cand else None}
            result["bundled"].append(row)
            print(f"{path.stem:>14} {model.name:>11} {elapsed:>7.2f} {cpu:>6.2f} "
                  f"{row['work'] if cand else '-':>5} {row['stopped_by']:>11} "
                  + (f"{row['iteration_time_s']:>9.4f}" if cand else f"{'-':>9}"))
    rows = [r for r in result["bundled"] if r["work"] is not None]
    print(f"{'':>14} most CPU-s {max(r['cpu_s'] for r in rows):.2f}; searches not complete: "
          f"{sum(r['stopped_by'] != 'complete' for r in rows)} of {len(rows)}")


def cost_replan_table(result: dict, models: dict) -> None:
    """Table 2, continued: re-plans of plans made with the cost objective on priced fleets (a
    floor of a fraction of the fleet's fastest throughput): per node on 1024 GPUs and per GPU on
    256, after losing a node the plan uses and the last node; and a floor out of reach (99.5%,
    the first 8 nodes lost), where the re-plan is the fastest plan (``kept`` no). With the USD
    per million tokens before and after."""
    print("\n== re-plan of plans made with --objective cost on priced fleets")
    print(f"{'model':>10} {'GPUs':>5} {'charge':>8} {'floor':>5} {'fleet now':>16} {'wall_s':>7} "
          f"{'cpu_s':>6} {'judged':>6} {'$/1M before':>11} {'$/1M after':>10} {'tokens/s':>10} "
          f"{'kept':>4} {'moves GiB':>9}")
    for gpus, charge, fraction in ((1024, "per-node", COST_REPLAN_FLOOR),
                                   (256, "per-gpu", COST_REPLAN_FLOOR), (1024, "per-node", 0.995)):
        cluster = fleet(gpus, priced=True)
        names = [n.name for n in cluster.nodes]
        for name in ("gpt3-1.3b", "llama2-7b"):
            gbs = 2 * gpus
            fastest = search(cluster, models[name], None, gbs, 1, progress=False, charge=charge)
            floor = fraction * fastest.cost.tokens_per_s
            try:
                plan = search(cluster, models[name], None, gbs, 1, progress=False,
                              objective="cost", min_tokens_per_s=floor, charge=charge)
            except FloorNotMet as exc:
                # The cost search's own fastest plan can fall short of the throughput search's
                # (a near-fastest floor): no plan to re-plan, the row says so.
                result["cost_replan"].append({
                    "model": name, "gpus": gpus, "charge": charge, "floor_fraction": fraction,
                    "floor_tokens_per_s": floor, "fleet": "floor not met",
                    "fastest_tokens_per_s": exc.fastest_tokens_per_s})
                print(f"{name:>10} {gpus:>5} {charge:>8} {fraction:>5.1%} {'floor not met':>16} "
                      f"(the cost search's fastest: {exc.fastest_tokens_per_s:,.0f} tokens/s, "
                      f"floor {floor:,.0f})")
                continue
            used = sorted({r.node for r in plan.plan.ranks})
            losses = ([[lost] for lost in dict.fromkeys((used[0], names[-1]))] if fraction < 0.9
                      else [names[:8]])
            for lost in losses:
                label = f"lost {lost[0]}" if len(lost) == 1 else f"lost {len(lost)} nodes"
                start, cpu = time.perf_counter(), time.process_time()
                new = replan(plan.plan, cluster.subset([n for n in names if n not in lost]),
                             models[name])
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
                kept = new.objective_note is None
                result["cost_replan"].append({
                    "model": name, "gpus": gpus, "charge": charge, "floor_fraction": fraction,
                    "fleet": label, "floor_tokens_per_s": floor, "replan_s": elapsed,
                    "cpu_s": cpu, "candidates": new.candidates,
                    "usd_per_million_tokens_before": plan.cost.usd_per_million_tokens,
                    "usd_per_million_tokens_after": new.cost.usd_per_million_tokens,
                    "tokens_per_s": new.cost.tokens_per_s, "objective_kept": kept,
                    "recovery_bytes": new.recovery_bytes, "stopped_by": new.stopped_by})
                print(f"{name:>10} {gpus:>5} {charge:>8} {fraction:>5.1%} {label:>16} "
                      f"{elapsed:>7.2f} {cpu:>6.2f} {new.candidates:>6} "
                      f"{plan.cost.usd_per_million_tokens:>11.4f} "
                      f"{new.cost.usd_per_million_tokens:>10.4f} {new.cost.tokens_per_s:>10.0f} "
                      f"{'yes' if kept else 'no':>4} {new.recovery_bytes / 2**30:>9.2f}")


def family_table(result: dict, args, models: dict) -> None:
    """Table 8: the CPU budget over the fleet family (module doc), each target's worst case."""
    print("\n== CPU seconds over a family of fleets (8-GPU nodes, 25 GB/s; global batch 2 x GPUs, "
          f"micro-batch 1; bf16); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
          "cores")
    print(f"{'fleet':>18} {'GPUs':>5} {'model':>10} {'task':>26} {'cpu_s':>7} {'wall_s':>7} "
          f"{'work':>5} {'ended':>11} {'iter_s':>8} {'idle':>5}")
    sizes = (1024,) if args.quick else (512, 1024, 2048, 4096)
    names = ("gpt3-1.3b",) if args.quick else ("gpt3-1.3b", "llama2-7b")
    rows = result["family"]

    def record(family, gpus, name, task, target, run):
        start, cpu = time.perf_counter(), cpu_seconds()
        out, ended, work, cost = run()
        row = {"fleet": family, "gpus": gpus, "model": name, "task": task, "target": target,
               "cpu_s": cpu_seconds() - cpu, "wall_s": time.perf_counter() - start,
               "work": work, "stopped_by": ended, "complete": ended == "complete",
               "iteration_time_s": cost.iteration_time_s,
               "idle_gpus": sum(cost.idle_gpus.values()), "load_average": os.getloadavg()[0]}
        rows.append(row)
        print(f"{family:>18} {gpus:>5} {name:>10} {task:>26} {row['cpu_s']:>7.2f} "
              f"{row['wall_s']:>7.2f} {work:>5} {ended:>11} {cost.iteration_time_s:>8.4f} "
              f"{row['idle_gpus']:>5}", flush=True)
        return out

    for family, types in FAMILY.items():
        for gpus in sizes:
            cluster = fleet(gpus, types)
            for name in names:
                def plan():
                    cand = search(cluster, models[name], None, 2 * gpus, 1, progress=False,
                                  time_limit_s=FAMILY_SAFETY_NET_S)
                    return cand, cand.stopped_by, cand.work, cand.cost
                target = f"plan {gpus} GPUs"
                cand = record(family, gpus, name, "plan", target if target in TARGETS_CPU_S
                              else None, plan)
                if gpus == 1024:
                    names_now = [n.name for n in cluster.nodes]
                    used = next(n for n in names_now if n in {r.node for r in cand.plan.ranks})
                    for lost in dict.fromkeys((used,) if args.quick else (used, names_now[-1])):
                        def again(lost=lost):
                            new = replan(cand.plan, cluster.subset(
                                [n for n in names_now if n != lost]), models[name],
                                time_limit_s=FAMILY_SAFETY_NET_S)
                            return new, new.stopped_by or "no search", new.candidates, new.cost
                        record(family, gpus, name, f"re-plan, lost {lost}",
                               "re-plan 1024 GPUs, one node lost", again)
                if gpus == 2048:
                    def both():
                        comp = compare(cluster, models[name], None, 2 * gpus, 1,
                                       progress=False, time_limit_s=FAMILY_SAFETY_NET_S)
                        ended = comp.stopped_by if all(
                            b.stopped_by == "complete" for b in comp.baselines) else "baseline cut"
                        return comp, ended, comp.work, comp.cost
                    record(family, gpus, name, "compare", "compare 2048 GPUs", both)
    print(f"\n{'target':>34} {'CPU-s':>6} {'worst':>7} {'cases':>5} {'complete':>8}  worst case")
    for target, limit in TARGETS_CPU_S.items():
        judged = [r for r in rows if r["target"] == target]
        worst = max(judged, key=lambda r: r["cpu_s"], default=None)
        entry = {"target": target, "limit_cpu_s": limit, "cases": len(judged),
                 "complete": sum(r["complete"] for r in judged),
                 "worst_cpu_s": worst["cpu_s"] if worst else None,
                 "worst_case": ({k: worst[k] for k in ("fleet", "gpus", "model", "task")}
                                if worst else None),
                 "met": bool(worst) and worst["cpu_s"] <= limit
                 and all(r["complete"] for r in judged)}
        result["family_worst"].append(entry)
        print(f"{target:>34} {limit:>6.1f} "
              + (f"{worst['cpu_s']:>7.2f} {len(judged):>5} {entry['complete']:>8}  "
                 f"{worst['fleet']} {worst['model']} {worst['task']}" if worst
                 else f"{'-':>7} {0:>5} {'-':>8}  not run (--quick)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(ROOT / "bench-out" / "bench_planner.json"),
                        help="where to write the results (default bench-out/, gitignored)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and cases")
    parser.add_argument("--optimality-only", type=int, default=None, metavar="SEEDS",
                        help="only table 5, with this many seeds of each kind of random fleet")
    parser.add_argument("--family-only", action="store_true",
                        help="only table 8, the CPU budget over the family of fleets")
    args = parser.parse_args()
    result = {"scaling": [], "bundled": [], "replan": [], "cost_replan": [], "baselines": [],
              "exhaustive": [], "random_gaps": [], "compare": [], "cost": [], "family": [],
              "family_worst": []}
    models = {n: load_model(ROOT / f"configs/models/{n}.yaml")
              for n in ("gpt3-1.3b", "gpt3-2.7b", "llama2-7b")}
    if args.optimality_only is not None:
        random_gap_table(result, args)
        write_json(result, args.json)
        return
    if args.family_only:
        family_table(result, args, models)
        write_json(result, args.json)
        return

    print("== solve time vs cluster size (global batch = max(64, 2 x GPUs), micro-batch 1); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'GPUs':>6} {'types':>5} {'model':>10} {'wall_s':>8} {'cpu_s':>7} {'work':>6} "
          f"{'ended':>11} {'pipelines':>9} {'idle':>5} {'iter_s':>8} {'tokens/s':>10} "
          f"{'effic':>6}")
    sizes = ((8, 3), (64, 3), (1024, 3), (4096, 4)) if args.quick else (
        (8, 3), (32, 3), (64, 3), (128, 3), (512, 3), (1024, 3), (2048, 3), (4096, 3), (4096, 4))
    four = TYPES + ("V100-32GB",)
    plans = {}
    for gpus, ntypes in sizes:
        for name in ("gpt3-1.3b", "llama2-7b"):
            cluster = fleet(gpus, TYPES if ntypes == 3 else four)
            start, cpu = time.perf_counter(), time.process_time()
            cand = search(cluster, models[name], None, max(64, 2 * gpus), 1, progress=False)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            idle = sum(cand.cost.idle_gpus.values())
            row = {"gpus": gpus, "gpu_types": ntypes, "model": name, "solve_s": elapsed,
                   "cpu_s": cpu, "work": cand.work, "stopped_by": cand.stopped_by,
                   "load_average": os.getloadavg()[0], "idle_gpus": idle,
                   "pipelines": len(cand.plan.pipelines),
                   "iteration_time_s": cand.cost.iteration_time_s,
                   "tokens_per_s": cand.cost.tokens_per_s, "tp": cand.tp_of_gpu,
                   "recompute": cand.recompute,
                   "efficiency": efficiency(cluster, models[name], cand.cost.tokens_per_s, 1)}
            result["scaling"].append(row)
            plans[gpus, ntypes, name] = cand.plan
            print(f"{gpus:>6} {ntypes:>5} {name:>10} {elapsed:>8.2f} {cpu:>7.2f} {cand.work:>6} "
                  f"{cand.stopped_by:>11} {row['pipelines']:>9} {idle:>5} "
                  f"{row['iteration_time_s']:>8.3f} {row['tokens_per_s']:>10.0f} "
                  f"{100 * row['efficiency']:>5.1f}%")

    bundled_table(result, args)

    print("\n== re-plan of the 1024-GPU plans (default tolerance 2%, work budget "
          f"{REPLAN_WORK_BUDGET} SCIP nodes)")
    print(f"{'model':>10} {'fleet now':>16} {'wall_s':>7} {'cpu_s':>6} {'judged':>6} "
          f"{'iter_s':>8} {'fastest_s':>9} {'moves GiB':>9} {'ended':>11}")
    cluster = fleet(1024)
    names = [n.name for n in cluster.nodes]
    for name in ("gpt3-1.3b", "llama2-7b"):
        for label, now in (("unchanged", cluster), (f"lost {names[0]}", cluster.subset(names[1:])),
                           (f"lost {names[-1]}", cluster.subset(names[:-1]))):
            start, cpu = time.perf_counter(), time.process_time()
            new = replan(plans[1024, 3, name], now, models[name])
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            row = {"model": name, "fleet": label, "replan_s": elapsed, "cpu_s": cpu,
                   "candidates": new.candidates, "iteration_time_s": new.cost.iteration_time_s,
                   "fastest_s": new.best_iteration_time_s, "recovery_bytes": new.recovery_bytes,
                   "stopped_by": new.stopped_by}
            result["replan"].append(row)
            print(f"{name:>10} {label:>16} {elapsed:>7.2f} {cpu:>6.2f} {new.candidates:>6} "
                  f"{new.cost.iteration_time_s:>8.4f} {new.best_iteration_time_s:>9.4f} "
                  f"{new.recovery_bytes / 2**30:>9.2f} {new.stopped_by or 'no search':>11}")
    cost_replan_table(result, models)

    print("\n== speedup over baselines on the bundled 3-type fleets")
    print(f"{'cluster':>14} {'model':>10} {'gbs':>4} {'mbs':>3} {'ours_s':>8} {'effic':>6} "
          f"{'megatron':>9} {'whale':>7} {'fastest':>8}")
    cases = [("gpt3-1.3b", 64, 1), ("gpt3-2.7b", 128, 1), ("llama2-7b", 256, 1),
             ("gpt3-1.3b", 512, 2)]
    for cname in ("a100-h800-h20", "a100-v100-t4"):
        cluster = load_cluster(ROOT / f"configs/clusters/{cname}.yaml")
        for name, gbs, mbs in cases[:2] if args.quick else cases:
            comp = compare(cluster, models[name], None, gbs, mbs, progress=False)
            row = {"cluster": cname, "model": name, "global_batch_size": gbs,
                   "micro_batch_size": mbs, **comp.to_dict(),
                   "efficiency": efficiency(cluster, models[name], comp.cost.tokens_per_s, mbs)}
            result["baselines"].append(row)
            sp = [comp.baselines[i].speedup for i in range(3)]
            fmt = [f"{s:.2f}x" if s else "none" for s in sp]
            print(f"{cname:>14} {name:>10} {gbs:>4} {mbs:>3} {comp.cost.iteration_time_s:>8.3f} "
                  f"{100 * row['efficiency']:>5.1f}% {fmt[0]:>9} {fmt[1]:>7} {fmt[2]:>8}")

    print("\n== gap to the exhaustive optimum (same cost model, same TP degrees and max stages)")
    print(f"{'case':>26} {'ours_s':>9} {'optimum_s':>9} {'gap':>7} {'ours_t':>7} {'brute_t':>7}")
    gpt8 = dataclasses.replace(models["gpt3-1.3b"], num_layers=8)
    tiny = load_model(ROOT / "configs/models/tiny.yaml")
    ex_cases = [
        ("local-4 tiny", load_cluster(ROOT / "configs/clusters/local-4.yaml"), tiny, 8, 2, None),
        ("8: A100x4 H20x2 T4x2", small("c8", [("A100-80GB", 4), ("H20", 2), ("T4", 2)]),
         gpt8, 32, 1, [2, 4]),
        ("8: A100x4 H800x4", small("c8b", [("A100-80GB", 4), ("H800", 4)]), gpt8, 32, 1, [2, 4]),
        ("16: A100x8 V100x4 T4x4", small("c16", [("A100-40GB", 8), ("V100-32GB", 4), ("T4", 4)]),
         gpt8, 64, 1, [4]),
        ("16: H800x8 A100x4 H20x4", small("c16b", [("H800", 8), ("A100-80GB", 4), ("H20", 4)]),
         gpt8, 64, 1, [4, 8]),
    ]
    for label, cluster, model, gbs, mbs, tps in ex_cases[:2] if args.quick else ex_cases:
        start = time.perf_counter()
        ours = search(cluster, model, None, gbs, mbs, progress=False, tp_degrees=tps, max_stages=4,
                      virtual_stages=False)
        t_ours = time.perf_counter() - start
        start = time.perf_counter()
        best = exhaustive_search(cluster, model, None, gbs, mbs, tp_degrees=tps, max_stages=4)
        t_best = time.perf_counter() - start
        gap = ours.cost.iteration_time_s / best.cost.iteration_time_s - 1
        result["exhaustive"].append({"case": label, "ours_s": ours.cost.iteration_time_s,
                                     "optimum_s": best.cost.iteration_time_s, "gap": gap,
                                     "planner_time_s": t_ours, "exhaustive_time_s": t_best})
        print(f"{label:>26} {ours.cost.iteration_time_s:>9.5f} {best.cost.iteration_time_s:>9.5f} "
              f"{100 * gap:>6.2f}% {t_ours:>7.2f} {t_best:>7.2f}")

    random_gap_table(result, args)

    print("\n== autohet compare (search + baselines) on 2048 GPUs, three types")
    print(f"{'model':>10} {'wall_s':>8} {'cpu_s':>7} {'ours_s':>8} {'megatron':>9} {'whale':>7} "
          f"{'fastest':>8} {'ended':>11}")
    for name in ("gpt3-1.3b",) if args.quick else ("gpt3-1.3b", "llama2-7b"):
        start, cpu = time.perf_counter(), time.process_time()
        comp = compare(fleet(2048), models[name], None, 4096, 1, progress=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        result["compare"].append({"gpus": 2048, "model": name, "compare_s": elapsed,
                                  "cpu_s": cpu, "stopped_by": comp.stopped_by, **comp.to_dict()})
        fmt = [f"{b.speedup:.2f}x" if b.speedup else "none" for b in comp.baselines]
        print(f"{name:>10} {elapsed:>8.2f} {cpu:>7.2f} {comp.cost.iteration_time_s:>8.3f} "
              f"{fmt[0]:>9} {fmt[1]:>7} {fmt[2]:>8} {comp.stopped_by:>11}")

    print("\n== cost objective: USD per million tokens, fastest plan vs cheapest plan "
          f"(spot prices {PRICES})")
    print(f"{'GPUs':>6} {'types':>5} {'model':>10} {'fast_$/1M':>9} {'cheap_$/1M':>10} "
          f"{'fast_iter':>9} {'cheap_iter':>10} {'cheap_idle':>24} {'cpu_s':>7} {'ended':>11}")
    cost_cases = ((64, 4), (512, 4)) if args.quick else ((64, 4), (512, 4), (1024, 4))
    for gpus, ntypes in cost_cases:
        cluster = fleet(gpus, four[:ntypes], priced=True)
        for name in ("gpt3-1.3b",) if args.quick else ("gpt3-1.3b", "llama2-7b"):
            gbs = max(64, 2 * gpus)
            fast = search(cluster, models[name], None, gbs, 1, progress=False)
            cpu = time.process_time()
            cheap = search(cluster, models[name], None, gbs, 1, progress=False, objective="cost")
            cpu = time.process_time() - cpu
            idle = ", ".join(f"{n} {g}" for g, n in cheap.cost.idle_gpus.items()) or "-"
            result["cost"].append({
                "gpus": gpus, "gpu_types": ntypes, "model": name, "prices": PRICES,
                "fastest_usd_per_million_tokens": fast.cost.usd_per_million_tokens,
                "cheapest_usd_per_million_tokens": cheap.cost.usd_per_million_tokens,
                "fastest_iteration_s": fast.cost.iteration_time_s,
                "cheapest_iteration_s": cheap.cost.iteration_time_s,
                "cheapest_idle_gpus": cheap.cost.idle_gpus, "cost_search_cpu_s": cpu,
                "stopped_by": cheap.stopped_by})
            print(f"{gpus:>6} {ntypes:>5} {name:>10} {fast.cost.usd_per_million_tokens:>9.4f} "
                  f"{cheap.cost.usd_per_million_tokens:>10.4f} {fast.cost.iteration_time_s:>9.3f} "
                  f"{cheap.cost.iteration_time_s:>10.3f} {idle:>24} {cpu:>7.2f} "
                  f"{cheap.stopped_by:>11}")

    family_table(result, args, models)
    write_json(result, args.json)



if __name__ == "__main__":
    main()
