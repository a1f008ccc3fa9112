"""`autohet show`: print a plan as a table and optionally draw it with its predicted timeline.

The table's times and memory are recomputed by the cost model when the cluster is known (given
with --cluster, or the bundled cluster the plan names), so a hand-edited plan shows its real
prediction; otherwise they are the predictions stored in the plan file.

The figure has two panels: the plan (one row per pipeline, one box per stage spanning its layers,
coloured by GPU type, labelled with TP degree and ranks) and the event-level 1F1B timeline of
every stage (``cost_model.simulate_1f1b``: forward and backward of each micro-batch, the link
transfers as gaps), with the gradient sync and the optimizer step after the pipelines drain.
Pipelines with identical timelines share one set of rows (labelled p4-11), so large fleets stay
readable.
"""

from __future__ import annotations

from pathlib import Path

from megatron_autohet.cli._common import (bundled_cluster_path, check_output_path,
                                          check_plan_on_cluster, format_plan_table,
                                          format_prediction, layer_range, load_profile, rank_list)
from megatron_autohet.cost_model import evaluate_plan, plan_charge, plan_memory_headroom
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import load_plan
from megatron_autohet.spec import load_cluster, load_gpu_catalog

# Colours per GPU type (matplotlib's tab10, in order of first appearance in the plan).
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "show", help="print a plan as a table; draw it and its predicted 1F1B timeline",
        description="Print a plan (pipelines x stages: ranks, node, GPU type, TP, layers, "
                    "micro-batches, predicted time per micro-batch and memory per GPU) and its "
                    "predicted iteration time. With --figure, draw the plan and the predicted "
                    "1F1B timeline of each pipeline to an image file.")
    p.add_argument("plan", metavar="plan.yaml", help="plan file written by `autohet plan`")
    p.add_argument("--cluster", default=None, metavar="C.yaml",
                   help="cluster the plan is for, to recompute predictions and the timeline "
                        "(default: the bundled configs/clusters/<plan's cluster>.yaml if it "
                        "exists, else the predictions stored in the plan)")
    p.add_argument("--profile", default=None, metavar="P.yaml",
                   help="profile to predict with (default: analytic estimates)")
    p.add_argument("--gpu-catalog", default=None, metavar="G.yaml",
                   help="GPU catalog (default: the bundled configs/gpus.yaml)")
    p.add_argument("--figure", default=None, metavar="plan.png",
                   help="draw the plan and its timeline to this image (.png, .svg, .pdf)")
    p.set_defaults(func=run)


def run(args) -> int:
    plan = load_plan(args.plan)
    if args.figure:
        check_figure_path(args.figure)
    cost = predict(plan, args)
    print(f"plan {args.plan}: {plan.model.name} on {plan.cluster}, {plan.world_size} GPUs, "
          f"{len(plan.pipelines)} pipelines")
    print(format_plan_table(plan, cost))
    print(format_prediction(plan, cost))
    if args.figure:
        draw_plan(plan, cost, args.figure)
        print(f"> wrote {args.figure}")
    return 0


def check_figure_path(path: str) -> None:
    """A writable place and an image format matplotlib knows (ConfigError naming --figure)."""
    # matplotlib: not at `autohet` start-up
    from matplotlib.figure import Figure

    check_output_path(path, "--figure")
    formats = Figure().canvas.get_supported_filetypes()
    if Path(path).suffix.lstrip(".").lower() not in formats:
        raise ConfigError("<command line>", "--figure", f"{path}: unknown image format",
                          "a name ending in " + ", ".join(f".{f}" for f in sorted(formats)))


def predict(plan, args):
    """PlanCost with timelines, or None when no cluster is known."""
    # pyscipopt: not at `autohet` start-up
    from megatron_autohet.planner.space import resolve_profile

    cluster_file = args.cluster or bundled_cluster_path(plan.cluster)
    if cluster_file is None:
        if args.profile:
            raise ConfigError("<command line>", "--profile", "needs the cluster to predict with",
                              f"--cluster (no bundled cluster is named {plan.cluster!r})")
        return None
    cluster = load_cluster(cluster_file, load_gpu_catalog(args.gpu_catalog))
    check_plan_on_cluster(plan, cluster, cluster_file)
    profile = load_profile(args.profile, plan.model.name) if args.profile else None
    profile = resolve_profile(cluster, plan.model, profile, plan.micro_batch_size, plan.seq_length)
    return evaluate_plan(plan, cluster, profile, with_timeline=True,
                         memory_headroom=plan_memory_headroom(plan), charge=plan_charge(plan))


def identical_pipelines(cost) -> list[list[int]]:
    """Pipelines with the same predicted timeline (same stage GPU types, TP, layers, sync times
    and the same simulated 1F1B events, which also reflect warm-up depths) grouped, so a 96-GPU
    fleet of a few pipeline shapes draws a few timelines."""
    groups: dict[tuple, list[int]] = {}
    for p, pcost in enumerate(cost.pipelines):
        key = (pcost.num_microbatches, tuple(
            (s.gpu, s.tp, s.layers, s.sync_s, tuple(s.timeline)) for s in pcost.stages))
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def draw_plan(plan, cost, path) -> None:
    """Write the figure described in the module docstring (without ``cost``: the plan panel)."""
    # matplotlib: not at `autohet` start-up
    import matplotlib

    matplotlib.use("Agg")
    # after matplotlib.use: pyplot takes the file-only backend (no display needed)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    gpus = list(dict.fromkeys(r.gpu for r in plan.ranks))
    colour = {g: PALETTE[i % len(PALETTE)] for i, g in enumerate(gpus)}
    groups = identical_pipelines(cost) if cost is not None else []
    timeline_rows = sum(len(cost.pipelines[g[0]].stages) for g in groups)
    plan_height = 0.7 * len(plan.pipelines) + 1.0
    timeline_height = 0.28 * timeline_rows + 1.2 if cost is not None else 0.0
    fig = plt.figure(figsize=(13, plan_height + timeline_height + 0.8))
    if cost is not None:
        ax_plan, ax_time = fig.subplots(2, 1, gridspec_kw={
            "height_ratios": [plan_height, timeline_height]})
    else:
        ax_plan, ax_time = fig.subplots(1, 1), None

    # -- the plan: pipelines as rows, stages as boxes spanning their layers ---------------------
    num_layers = plan.model.num_layers
    for p, pipe in enumerate(plan.pipelines):
        y = len(plan.pipelines) - 1 - p
        for s, stage in enumerate(pipe.stages):
            gpu = plan.ranks[stage.ranks[0]].gpu
            start, end = stage.layers
            ax_plan.barh(y, end - start, left=start, height=0.8, color=colour[gpu],
                         edgecolor="black", linewidth=0.8)
            label = f"L{layer_range(stage.layers)}\nTP{stage.tp} r{rank_list(stage.ranks)}"
            ax_plan.text((start + end) / 2, y, label, ha="center", va="center", fontsize=7,
                         color="white", clip_on=True)
    ax_plan.set_yticks(range(len(plan.pipelines)))
    ax_plan.set_yticklabels([f"pipeline {p}\n{pipe.num_microbatches} mb"
                             for p, pipe in reversed(list(enumerate(plan.pipelines)))], fontsize=8)
    ax_plan.set_xlim(0, num_layers)
    ax_plan.set_xlabel("transformer layer")
    ax_plan.set_title(f"{plan.model.name} on {plan.cluster}: {plan.world_size} GPUs, "
                      f"{len(plan.pipelines)} pipelines, global batch {plan.global_batch_size} "
                      f"(micro-batch {plan.micro_batch_size})", fontsize=10)
    ax_plan.legend(handles=[Patch(color=colour[g], label=g) for g in gpus], loc="upper left",
                   bbox_to_anchor=(1.0, 1.0), fontsize=8, title="GPU type", title_fontsize=8)

    # -- the predicted 1F1B timeline of every stage ---------------------------------------------
    if ax_time is not None:
        labels, y = [], timeline_rows - 1
        for members in groups:
            pcost = cost.pipelines[members[0]]
            name = f"p{members[0]}" if len(members) == 1 else f"p{members[0]}-{members[-1]}"
            for s, scost in enumerate(pcost.stages):
                c = colour[scost.gpu]
                fwd = [(e.start_s, e.end_s - e.start_s) for e in scost.timeline if e.kind == "fwd"]
                bwd = [(e.start_s, e.end_s - e.start_s) for e in scost.timeline if e.kind == "bwd"]
                ax_time.broken_barh(fwd, (y - 0.4, 0.8), facecolors=c, alpha=0.55,
                                    edgecolor="white", linewidth=0.3)
                ax_time.broken_barh(bwd, (y - 0.4, 0.8), facecolors=c, alpha=1.0,
                                    edgecolor="white", linewidth=0.3)
                # After the pipelines drain: this stage's gradient sync, then the optimizer step.
                ax_time.broken_barh([(cost.pipeline_time_s, scost.sync_s),
                                     (cost.pipeline_time_s + cost.grad_sync_s, scost.optimizer_s)],
                                    (y - 0.4, 0.8), facecolors=["#999999", "#444444"])
                labels.append((y, f"{name} s{s} {scost.gpu} TP{scost.tp}"))
                y -= 1
        ax_time.axvline(cost.pipeline_time_s, color="black", linestyle="--", linewidth=0.8)
        ax_time.axvline(cost.iteration_time_s, color="red", linestyle="-", linewidth=0.8)
        ax_time.set_yticks([t for t, _ in labels])
        ax_time.set_yticklabels([label for _, label in labels], fontsize=7)
        ax_time.set_ylim(-0.6, timeline_rows - 0.4)
        ax_time.set_xlim(0, cost.iteration_time_s * 1.02)
        ax_time.set_xlabel("time in the iteration (s)")
        ax_time.set_title(f"predicted 1F1B timeline: iteration {cost.iteration_time_s:.3g} s, "
                          f"{cost.tokens_per_s:,.0f} tokens/s", fontsize=10)
        ax_time.legend(handles=[Patch(color="#bbbbbb", label="forward (light)"),
                                Patch(color="#555555", label="backward (dark)"),
                                Patch(color="#999999", label="gradient sync"),
                                Patch(color="#444444", label="optimizer step")],
                       loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
