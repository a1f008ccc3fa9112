"""`autohet compare`: our plan against the plans a user would otherwise run, same cost model."""

from __future__ import annotations

import json

from megatron_autohet.cli._common import (add_planning_arguments, counted, floor_error,
                                          format_hours, format_idle, format_tokens,
                                          load_planning_inputs, planning_options,
                                          print_cut_warning, search_end)
from megatron_autohet.cli._table import format_table


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="predicted speedup of our plan over Megatron-LM, Whale-style, ... plans",
        description="Plan the cluster as `autohet plan` does, build the baselines (Megatron-LM: "
                    "the best single TP x PP x DP grid with uniform layers and batches; "
                    "Whale-style: the same grids with batch shares proportional to replica "
                    "speed; the fastest GPU type alone; on a fleet across zones the "
                    "zone-oblivious plan, planned with the zones ignored and priced with them, "
                    "and the best single-zone plan) and print, for each, the predicted "
                    "iteration time, tokens/s and the speedup of our plan over it. All plans are "
                    "judged by the same cost model and profile, with their USD per million "
                    "tokens when the nodes have spot prices and, with --train-tokens, the time "
                    "and USD to train them.")
    add_planning_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print the comparison as JSON on stdout instead of a table")
    p.add_argument("-o", "--output", default=None, metavar="plan.yaml",
                   help="also write our plan here (default: not written)")
    p.set_defaults(func=run)


def run(args) -> int:
    # pyscipopt (the planner's SCIP) only when a command plans, not at `autohet` start-up
    from megatron_autohet.planner.compare import compare
    from megatron_autohet.planner.cost_search import FloorNotMet

    cluster, model, profile = load_planning_inputs(args)
    options = planning_options(args)
    floor = options["min_tokens_per_s"]
    try:
        result = compare(cluster, model, profile, args.global_batch_size, args.micro_batch_size,
                         args.seq_length, progress=not args.json, cluster_file=args.cluster,
                         **options)
    except FloorNotMet as exc:
        raise floor_error(args, exc) from None
    if args.output:
        result.plan.save(args.output)
    plans = [("autohet (ours)", result.cost, None)] + [
        (b.name, b.cost, b) for b in result.baselines + result.zone_plans]

    def training(cost) -> dict:
        """Time and USD to train --train-tokens, and whether the floor is met."""
        out = {}
        if args.train_tokens is not None:
            out["hours_to_train"] = cost.hours_to_train(args.train_tokens)
            out["usd_to_train"] = (None if cost.usd_per_million_tokens is None
                                   else cost.usd_per_million_tokens * args.train_tokens / 1e6)
        if floor is not None:
            out["meets_floor"] = cost.tokens_per_s >= floor
        return out

    if args.json:
        data = {"cluster": cluster.name, "model": model.name,
                "global_batch_size": args.global_batch_size,
                "micro_batch_size": args.micro_batch_size,
                "seq_length": result.plan.seq_length, "train_tokens": args.train_tokens,
                "min_tokens_per_s": floor, **result.to_dict()}
        data["autohet"].update(training(result.cost))
        for entry, (_, cost, _) in zip(data["baselines"] + data.get("zone_plans", []),
                                       plans[1:]):
            entry.update(training(cost) if cost is not None else {})
        print(json.dumps(data, indent=1))
        return 0
    print(f"> {model.name} on {cluster.name} ({cluster.world_size} GPUs), global batch "
          f"{args.global_batch_size}, micro-batch {args.micro_batch_size}, seq "
          f"{result.plan.seq_length}"
          + ("" if floor is None else f"; ours: the cheapest plan ({options['charge']}) "
             f"training at least {floor:,.0f} tokens/s"))
    priced = result.cost.usd_per_million_tokens is not None
    header = ["plan", "iteration s", "tokens/s"]
    if priced:
        # on a fleet across zones the price includes the egress of the bytes crossing them
        header.append(f"$/1M tokens ({options['charge']}"
                      + (", egress included)" if cluster.regions else ")"))
    if args.train_tokens is not None:
        header.append(f"time to train {format_tokens(args.train_tokens)}")
        header += ["$ to train"] if priced else []
    if floor is not None:
        header.append("meets floor")
    header += ["our speedup", "idle GPUs", "layout"]
    rows = []
    for name, cost, baseline in plans:
        if cost is None:
            rows.append([name] + ["-"] * (len(header) - 2) + [baseline.note])
            continue
        row = [name, f"{cost.iteration_time_s:.4g}", f"{cost.tokens_per_s:,.0f}"]
        if priced:
            row.append("-" if cost.usd_per_million_tokens is None
                       else f"{cost.usd_per_million_tokens:.4g}")
        figures = training(cost)
        if args.train_tokens is not None:
            row.append(format_hours(figures["hours_to_train"]))
            if priced:
                row.append("-" if figures["usd_to_train"] is None
                           else f"{figures['usd_to_train']:,.0f}")
        if floor is not None:
            row.append("yes" if figures["meets_floor"] else "no")
        if baseline is None:
            row += ["1.00x", format_idle(cost.idle_gpus),
                    f"{counted(len(result.plan.pipelines), 'pipeline')}, recompute "
                    f"{'on' if result.plan.activation_recompute else 'off'}"]
        else:
            row += [f"{baseline.speedup:.2f}x", format_idle(cost.idle_gpus), baseline.note]
        rows.append(row)
    print(format_table(header, rows))
    # whether each search completed: ours as `autohet plan` says it; the baselines judge
    # every grid (or bound it out), never cut
    print_cut_warning(result, args.time_limit)
    print(f"> searches: autohet (ours) {search_end(result)}; baselines complete (every grid "
          f"judged)" + "".join(f"; {z.name} {search_end(z)}" for z in result.zone_plans
                               if z.plan is not None))
    if args.output:
        print(f"> wrote {args.output}")
    return 0
