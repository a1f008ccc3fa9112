"""`autohet compare`: our plan against the plans a user would otherwise run, same cost model."""

from __future__ import annotations

import json

from megatron_autohet.cli._common import (add_planning_arguments, format_idle,
                                          load_planning_inputs, planning_options)
from megatron_autohet.cli._table import format_table


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="predicted speedup of our plan over Megatron-LM, Whale-style, ... plans",
        description="Plan the cluster as `autohet plan` does, build the baselines (Megatron-LM: "
                    "the best single TP x PP x DP grid with uniform layers and batches; "
                    "Whale-style: the same grids with batch shares proportional to replica "
                    "speed; the fastest GPU type alone) and print, for each, the predicted "
                    "iteration time, tokens/s and the speedup of our plan over it. All plans are "
                    "judged by the same cost model and profile.")
    add_planning_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print the comparison as JSON on stdout instead of a table")
    p.add_argument("-o", "--output", default=None, metavar="plan.yaml",
                   help="also write our plan here (default: not written)")
    p.set_defaults(func=run)


def run(args) -> int:
    from megatron_autohet.planner.compare import compare

    cluster, model, profile = load_planning_inputs(args)
    result = compare(cluster, model, profile, args.global_batch_size, args.micro_batch_size,
                     args.seq_length, progress=not args.json, cluster_file=args.cluster,
                     **planning_options(args))
    if args.output:
        result.plan.save(args.output)
    if args.json:
        data = {"cluster": cluster.name, "model": model.name,
                "global_batch_size": args.global_batch_size,
                "micro_batch_size": args.micro_batch_size,
                "seq_length": result.plan.seq_length, **result.to_dict()}
        print(json.dumps(data, indent=1))
        return 0
    print(f"> {model.name} on {cluster.name} ({cluster.world_size} GPUs), global batch "
          f"{args.global_batch_size}, micro-batch {args.micro_batch_size}, seq "
          f"{result.plan.seq_length}")
    priced = result.cost.usd_per_million_tokens is not None

    def price(cost) -> list[str]:
        if not priced:
            return []
        return ["-" if cost is None or cost.usd_per_million_tokens is None
                else f"{cost.usd_per_million_tokens:.4g}"]

    rows = [["autohet (ours)", f"{result.cost.iteration_time_s:.4g}",
             f"{result.cost.tokens_per_s:,.0f}", *price(result.cost), "1.00x",
             format_idle(result.cost.idle_gpus),
             f"{len(result.plan.pipelines)} pipelines, recompute "
             f"{'on' if result.plan.activation_recompute else 'off'}"]]
    for b in result.baselines:
        if b.cost is None:
            rows.append([b.name, "-", "-", *price(None), "-", "-", b.note])
        else:
            rows.append([b.name, f"{b.cost.iteration_time_s:.4g}", f"{b.cost.tokens_per_s:,.0f}",
                         *price(b.cost), f"{b.speedup:.2f}x", format_idle(b.cost.idle_gpus),
                         b.note])
    print(format_table(["plan", "iteration s", "tokens/s", *(["$/1M tokens"] if priced else []),
                        "our speedup", "idle GPUs", "layout"], rows))
    if args.output:
        print(f"> wrote {args.output}")
    return 0
