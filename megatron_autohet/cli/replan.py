"""`autohet replan`: the plan to restart with after the fleet changed, preferring plans that
leave the training state where it is."""

from __future__ import annotations

import time

from megatron_autohet.cli._common import (check_output_path, format_plan_table, format_prediction,
                                          load_profiles, positive, print_cut_warning,
                                          search_end)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import load_plan
from megatron_autohet.spec import load_cluster, load_gpu_catalog, load_model


def format_bytes(n: float) -> str:
    """'0 B', '512 B', '1.5 KiB', '2.34 GiB': about three digits in the largest unit."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            break
        n /= 1024
    if unit == "B":
        return f"{n} B"
    return f"{n:.3g} {unit}" if n < 1000 else f"{n:.0f} {unit}"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "replan", help="re-plan for the fleet present now, moving little training state",
        description="After a preemption or a node joining: the plan for the nodes in --cluster, "
                    "with the previous plan's model and batch. An unchanged fleet keeps the "
                    "previous plan; otherwise the previous plan adapted to the survivors and the "
                    "planner's search are compared and, of the plans within --tolerance of the "
                    "fastest, the one whose recovery moves the fewest bytes across nodes wins "
                    "(a node keeps its name, and its local checkpoint, across the change). "
                    "A plan made with --objective cost stays the cheapest plan reaching its "
                    "throughput floor, compared in USD per million tokens (the fastest plan "
                    "where the fleet now present cannot reach the floor, which is then said).")
    p.add_argument("--plan", required=True, metavar="old.yaml",
                   help="the plan the job ran with before the change")
    p.add_argument("--cluster", required=True, metavar="C.yaml",
                   help="cluster file of the fleet present now")
    p.add_argument("--model", required=True, metavar="M.yaml",
                   help="model file; must be the previous plan's model")
    p.add_argument("--global-batch-size", type=int, default=None, metavar="N",
                   help="must equal the previous plan's (default: the previous plan's)")
    p.add_argument("--tolerance", type=float, default=0.02, metavar="FRACTION",
                   help="iteration time (for a plan made with --objective cost: USD per "
                        "million tokens) given up for moving less state (default: 0.02)")
    p.add_argument("--profile", action="append", default=None, metavar="P.yaml",
                   help="profile from `autohet profile` or a job's --autohet-measured-profile; "
                        "several are merged, the most measured entry of each key (then the "
                        "first given) (default: the profile the previous plan was priced on)")
    p.add_argument("--gpu-catalog", default=None, metavar="G.yaml",
                   help="GPU catalog (default: the bundled configs/gpus.yaml)")
    # (the defaults are planner/replan.py's, imported only when the command runs)
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="wall-clock safety net of the search (default: 10); its budget is "
                        "counted in work (10 SCIP nodes), so the same input gives the same plan "
                        "on any machine unless this limit cuts it, which the output then says")
    p.add_argument("-o", "--output", required=True, metavar="plan.yaml",
                   help="where to write the new plan")
    p.set_defaults(func=run)


def _check_against_plan(previous, model, args) -> None:
    """The model and batch must be the previous plan's: training continues, it does not
    restart with another model or batch."""
    if model != previous.model:
        field = next(f for f, v in model.to_dict().items() if previous.model.to_dict()[f] != v)
        raise ConfigError(args.model, field, f"{getattr(model, field)!r}, the previous plan "
                          f"{args.plan} has {getattr(previous.model, field)!r}",
                          "the previous plan's model")
    if args.global_batch_size is not None and \
            args.global_batch_size != previous.global_batch_size:
        raise ConfigError("<command line>", "--global-batch-size", f"{args.global_batch_size}, "
                          f"the previous plan {args.plan} has {previous.global_batch_size}",
                          "the previous plan's global batch (or leave it out)")
    if not args.tolerance >= 0:
        raise ConfigError("<command line>", "--tolerance", f"got {args.tolerance}",
                          "a fraction >= 0")
    if args.time_limit is not None:
        positive(args.time_limit, "--time-limit")


def run(args) -> int:
    # torch, pyscipopt: not at `autohet` start-up
    from megatron_autohet.planner.replan import REPLAN_TIME_LIMIT_S, replan

    check_output_path(args.output, "--output")
    previous = load_plan(args.plan)
    cluster = load_cluster(args.cluster, load_gpu_catalog(args.gpu_catalog))
    model = load_model(args.model)
    _check_against_plan(previous, model, args)
    profile = load_profiles(args.profile, model.name)
    print(f"> re-planning {model.name} from {args.plan} ({previous.world_size} GPUs on "
          f"{previous.cluster}) for {cluster.name}: {cluster.world_size} GPUs "
          f"({', '.join(f'{n} x {g}' for g, n in cluster.counts_by_type().items())}), "
          f"global batch {previous.global_batch_size}")
    started = time.perf_counter()
    result = replan(previous, cluster, model, profile, tolerance=args.tolerance,
                    time_limit_s=args.time_limit or REPLAN_TIME_LIMIT_S,
                    cluster_file=args.cluster)
    elapsed = time.perf_counter() - started
    result.plan.save(args.output)
    print(format_plan_table(result.plan, result.cost, cluster))
    print(format_prediction(result.plan, result.cost))
    old_nodes = {r.node for r in previous.ranks}
    kept = len(old_nodes & {n.name for n in cluster.nodes})
    print(f"> recovery moves {format_bytes(result.recovery_bytes)} across nodes (previous "
          f"plan's state kept on {kept} of {len(old_nodes)} nodes)")
    if result.unchanged:
        print(f"> fleet unchanged: kept the previous plan; wrote {args.output}")
    else:
        best = f"fastest {result.best_iteration_time_s:.4g} s"
        if result.cheapest_usd_per_million_tokens is not None:
            floor = previous.min_tokens_per_s
            best = (f"the plan's objective: cheapest {result.cheapest_usd_per_million_tokens:.4g}"
                    " USD per million tokens" + (f" at {floor:,.0f} tokens/s or more"
                                                 if floor else ""))
        if result.objective_warning:
            print(f"> WARNING: {result.objective_warning}")
        print_cut_warning(result, args.time_limit or REPLAN_TIME_LIMIT_S)
        print(f"> compared {result.candidates} plans in {elapsed:.1f} s ({best}, tolerance "
              f"{args.tolerance:.0%}; search {search_end(result)}); wrote {args.output}")
    return 0
