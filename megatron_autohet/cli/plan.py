"""`autohet plan`: search the fastest plan for a cluster and a model, write plan.yaml."""

from __future__ import annotations

import time

from megatron_autohet.cli._common import (add_planning_arguments, floor_error, format_idle,
                                          format_plan_table, format_prediction,
                                          load_planning_inputs, planning_options,
                                          print_cut_warning, search_end)
from megatron_autohet.cost_model import annotate_plan


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="find the fastest plan for a cluster and a model, write plan.yaml",
        description="Choose TP groups, pipelines (of possibly different shapes and GPU types), "
                    "layers per stage and micro-batches per pipeline that minimise the predicted "
                    "iteration time under every GPU's memory (SCIP). Writes the plan file the "
                    "runtime trains from and prints it with its predicted iteration time and "
                    "throughput.")
    add_planning_arguments(p)
    p.add_argument("--tp", type=int, nargs="+", default=None, metavar="T",
                   help="only search these TP degrees (default: every degree that divides the "
                        "model's heads and every node's GPU count)")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="plan for Megatron-LM's distributed optimizer: Adam state sharded over "
                        "each parameter's holders (less memory, a reduce-scatter + all-gather "
                        "instead of the all-reduce); recorded in the plan, which then trains "
                        "with it")
    p.add_argument("-o", "--output", required=True, metavar="plan.yaml",
                   help="where to write the plan")
    p.set_defaults(func=run)


def run(args) -> int:
    # pyscipopt (the planner's SCIP) only when a command plans, not at `autohet` start-up
    from megatron_autohet.planner.cost_search import FloorNotMet
    from megatron_autohet.planner.search import search
    from megatron_autohet.planner.space import trainable_for

    cluster, model, profile = load_planning_inputs(args)
    # The plan trains in the precision it is priced in: GPUs that cannot (V100s and T4s in
    # bf16) are left out of it and count as its idle GPUs (the search decides, as for every
    # caller; the first line says so).
    trainable, left_out = trainable_for(cluster, profile, args.cluster)
    print(f"> planning {model.name} on {cluster.name}: {trainable.world_size} GPUs "
          f"({', '.join(f'{n} x {g}' for g, n in trainable.counts_by_type().items())}"
          + (f"; left out, no bf16: {format_idle(left_out)}" if left_out else "")
          + f"), global batch {args.global_batch_size}, micro-batch {args.micro_batch_size}")
    options = planning_options(args)
    if options["min_tokens_per_s"] is not None:
        print(f"> the cheapest plan ({options['charge']}) training at least "
              f"{options['min_tokens_per_s']:,.0f} tokens/s")
    started = time.perf_counter()
    try:
        best = search(cluster, model, profile, args.global_batch_size, args.micro_batch_size,
                      args.seq_length, tp_degrees=args.tp,
                      distributed_optimizer=args.use_distributed_optimizer,
                      cluster_file=args.cluster, **options)
    except FloorNotMet as exc:
        raise floor_error(args, exc) from None
    elapsed = time.perf_counter() - started
    cost = best.cost
    annotate_plan(best.plan, cost)
    best.plan.save(args.output)
    print(format_plan_table(best.plan, cost, cluster))
    print(format_prediction(best.plan, cost, args.train_tokens))
    tp = ", ".join(f"{g} TP{t}" for g, t in best.tp_of_gpu.items())
    print_cut_warning(best, args.time_limit)
    print(f"> searched in {elapsed:.1f} s ({tp}; {search_end(best)}); wrote {args.output}")
    return 0
