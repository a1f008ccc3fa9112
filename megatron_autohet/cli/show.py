"""`autohet show`: print a plan as a table and optionally draw it with its predicted timeline.

The table's times and memory are recomputed by the cost model when the cluster is known (given
with --cluster, or the bundled cluster the plan names), so a hand-edited plan shows its real
prediction; otherwise they are the predictions stored in the plan file. On a cluster across zones
the table has each stage's zone.

The figure has two panels: the plan (one row per pipeline, one box per stage spanning its layers,
coloured by GPU type, labelled with TP degree and ranks; on a fleet across zones hatched by
zone, labelled with it, and a red line where a pipeline crosses zones) and the event-level 1F1B
timeline of every stage (``cost_model.simulate_1f1b``: forward and backward of each
micro-batch, the link transfers as gaps), with the gradient sync and the optimizer step after
the pipelines drain.
Pipelines with identical timelines share one set of rows (labelled p4-11), so large fleets stay
readable.

``--measured FILE`` (the ``--autohet-measured-jsonl`` file of a job that trained the plan) adds
what the job measured beside the prediction: the newest window of this plan in the file (or the
one ``--window ITER`` holds), per stage its phases predicted and measured with their ratio -
compute (forward + backward of one micro-batch, the drift rule's figure, runtime/stage_drift.py),
P2P waits, gradient sync and optimizer step per iteration. The predicted waits are the stage's
share of its pipeline's time that is not its compute (fill, drain and transfers), its gradient
sync phase is the wait for the slowest pipeline plus the plan's sync, as a rank measures them.
With ``--figure`` a third panel draws both, stage by stage. A file that is not a measured JSONL,
or holds no window of this plan (other stages, ranks or layers), is one line and status 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_autohet.cli._common import (PROFILE_ARGUMENT, bundled_cluster_path,
                                          check_output_path, check_plan_on_cluster, chunk_ranges,
                                          counted, format_plan_table, format_prediction,
                                          layer_range, load_profiles, rank_list)
from megatron_autohet.cli._table import format_table
from megatron_autohet.cost_model import evaluate_plan, plan_charge, plan_memory_headroom
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import load_plan
from megatron_autohet.runtime.stage_drift import DRIFT_THRESHOLD, PHASES
from megatron_autohet.spec import load_cluster, load_gpu_catalog

# Colours per GPU type (matplotlib's tab10, in order of first appearance in the plan).
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]
# A forward is its GPU type's colour in this shade, a backward the full colour.
FORWARD_ALPHA = 0.55
# The gradient sync hatched light grey and the optimizer step black: apart from every GPU type's
# colour and from each other at a glance, in both the timeline and the measured panel.
SYNC_STYLE = {"facecolor": "#d9d9d9", "hatch": "////", "edgecolor": "#666666"}
OPTIMIZER_STYLE = {"facecolor": "#111111", "hatch": None, "edgecolor": "#111111"}
# On a fleet across zones, a stage's box is hatched by its zone (the first zone plain: a fleet
# mostly in one zone reads as before) and a pipeline boundary between zones is a red line.
ZONE_HATCHES = [None, "..", "xx", "\\\\", "++", "oo"]
ZONE_CROSSING_STYLE = {"color": "#e41a1c", "linewidth": 2.5}


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
    p.add_argument("--profile", **PROFILE_ARGUMENT)
    p.add_argument("--gpu-catalog", default=None, metavar="G.yaml",
                   help="GPU catalog (default: the bundled configs/gpus.yaml)")
    p.add_argument("--figure", default=None, metavar="plan.png",
                   help="draw the plan and its timeline to this image (.png, .svg, .pdf)")
    p.add_argument("--measured", default=None, metavar="M.jsonl",
                   help="the --autohet-measured-jsonl file of a job that trained this plan: "
                        "show each stage's measured compute, P2P waits, gradient sync and "
                        "optimizer step beside the predicted ones (default: its newest window "
                        "of this plan)")
    p.add_argument("--window", type=int, default=None, metavar="ITER",
                   help="with --measured: the window that holds iteration ITER")
    p.set_defaults(func=run)


def run(args) -> int:
    plan = load_plan(args.plan)
    if args.figure:
        check_figure_path(args.figure)
    if args.window is not None and args.measured is None:
        raise ConfigError("<command line>", "--window", "needs --measured",
                          "--measured M.jsonl --window ITER")
    measured = (measured_window(plan, args.measured, args.window) if args.measured is not None
                else None)
    cluster = plan_cluster(plan, args)
    cost = predict(plan, args, cluster)
    print(f"plan {args.plan}: {plan.model.name} on {plan.cluster}, "
          f"{counted(plan.world_size, 'GPU')}, {counted(len(plan.pipelines), 'pipeline')}")
    print(format_plan_table(plan, cost, cluster))
    print(format_prediction(plan, cost))
    if measured is not None:
        window, skipped = measured
        print(format_measured(plan, cost, window, args.measured, skipped))
    if args.figure:
        draw_plan(plan, cost, args.figure, measured[0] if measured else None,
                  node_zones(cluster))
        print(f"> wrote {args.figure}")
        if cost is None:
            print(f"> no timeline in the figure: no bundled cluster is named {plan.cluster!r}; "
                  "--cluster C.yaml (the plan's cluster) adds it")
    return 0


# ---- --measured: a job's windows beside the prediction ------------------------------------

_WHAT = "the --autohet-measured-jsonl file of a job that trained this plan"


def _stage_key(plan, p: int, s: int) -> tuple:
    stage, pipe = plan.pipelines[p].stages[s], plan.pipelines[p]
    return (p, s, plan.ranks[stage.ranks[0]].gpu, tuple(stage.ranks), tuple(stage.layers),
            pipe.num_microbatches)


def _describe(key: tuple) -> str:
    p, s, gpu, ranks, layers, m = key
    return (f"pipeline {p} stage {s}: {gpu} ranks {rank_list(list(ranks))} layers "
            f"{layer_range(layers)}, {m} micro-batches")


def _record_keys(record: dict) -> list[tuple]:
    return [(st["pipeline"], st["stage"], st["gpu"], tuple(st["ranks"]), tuple(st["layers"]),
             st["num_microbatches"]) for st in record["stages"]]


def _mismatch(plan, record: dict) -> str | None:
    """How a window's stages differ from the plan's (None: they are the plan's)."""
    mine = [_stage_key(plan, p, s) for p, pipe in enumerate(plan.pipelines)
            for s in range(len(pipe.stages))]
    theirs = _record_keys(record)
    if len(theirs) != len(mine):
        return f"{len(theirs)} stages, the plan has {len(mine)}"
    for a, b in zip(theirs, mine):
        if a != b:
            return f"{_describe(a)}; the plan's {_describe(b)}"
    return None


def read_windows(path: str) -> list[dict]:
    """The windows of a measured JSONL (runtime/stage_drift.py ``WindowReport.to_dict``, one a
    line), checked enough to be shown: ConfigError naming the file and line otherwise."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(path, "<file>", "file not found", _WHAT)
    windows = []
    try:
        lines = file.read_text().splitlines()
    except UnicodeDecodeError:
        raise ConfigError(path, "<file>", "not a text file", _WHAT) from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            window = record["window"]
            first, last = int(window[0]), int(window[1])
            stages = record["stages"]
            for st in stages:
                _record_keys({"stages": [st]})
                for phase in PHASES:
                    float(st[f"{phase}_s"])
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ConfigError(path, f"line {n}", "not a measurement window "
                              f"({type(exc).__name__}: {exc})", _WHAT) from None
        windows.append({**record, "window": [first, last]})
    if not windows:
        raise ConfigError(path, "<file>", "no measurement window in it", _WHAT)
    return windows


def measured_window(plan, path: str, iteration: int | None = None) -> tuple[dict, int]:
    """(the window to show, how many newer windows of other plans were passed over): the newest
    window of this plan in the file, or the one holding ``iteration``. A job that re-planned
    (elastic) or appended another run writes windows of other plans to the same file."""
    windows = read_windows(path)
    ours = [i for i, w in enumerate(windows) if _mismatch(plan, w) is None]
    if not ours:
        newest = windows[-1]
        first, last = newest["window"]
        raise ConfigError(path, "stages", f"no window of this plan: the newest (iterations "
                          f"{first}-{last}) has {_mismatch(plan, newest)}", _WHAT)
    if iteration is None:
        chosen = ours[-1]
    else:
        held = [i for i in ours if windows[i]["window"][0] <= iteration <= windows[i]["window"][1]]
        if not held:
            raise ConfigError("<command line>", "--window", f"no window of this plan in {path} "
                              f"holds iteration {iteration}", "an iteration of " + ", ".join(
                                  "{}-{}".format(*windows[i]["window"]) for i in ours))
        chosen = held[-1]
    skipped = sum(1 for i in range(chosen + 1, len(windows)) if i not in ours)
    return windows[chosen], skipped


def predicted_phases(plan, cost) -> list[dict[str, float | None]]:
    """Per stage (pipeline by pipeline) the predicted seconds of what a rank measures (module
    doc): compute of one micro-batch, P2P waits, gradient sync and optimizer per iteration;
    None where nothing is known (no cluster: the plan file's stage times only)."""
    out = []
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            if cost is None:
                out.append({"compute": stage.predicted_time_s, "p2p_wait": None,
                            "grad_sync": None, "optimizer": None})
                continue
            pcost, sc = cost.pipelines[p], cost.pipelines[p].stages[s]
            out.append({"compute": sc.time_s,
                        "p2p_wait": max(0.0, pcost.time_s - pcost.num_microbatches * sc.time_s),
                        "grad_sync": cost.pipeline_time_s - pcost.time_s + cost.grad_sync_s,
                        "optimizer": sc.optimizer_s})
    return out


def measured_phases(window: dict) -> list[dict[str, float]]:
    """Per stage the measured seconds in :func:`predicted_phases`' terms."""
    return [{"compute": st["compute_s"] / st["num_microbatches"],
             **{phase: st[f"{phase}_s"] for phase in PHASES[1:]}} for st in window["stages"]]


def _cell(predicted: float | None, measured: float) -> str:
    text = ("-" if predicted is None else f"{predicted * 1e3:.3g}") + f" / {measured * 1e3:.3g}"
    if predicted:
        text += f" ({measured / predicted:.2f}x)"
    return text


def format_measured(plan, cost, window: dict, path: str, skipped: int = 0) -> str:
    """The window's table: predicted / measured (ratio) per stage and phase."""
    first, last = window["window"]
    predicted, measured = predicted_phases(plan, cost), measured_phases(window)
    rows = []
    for st, pred, meas in zip(window["stages"], predicted, measured):
        ratio = None if not pred["compute"] else meas["compute"] / pred["compute"]
        rows.append([st["pipeline"] if st["stage"] == 0 else "", st["stage"], st["gpu"],
                     len(st["ranks"]), *(_cell(pred[phase], meas[phase]) for phase in PHASES),
                     "" if ratio is None else ("DRIFT" if abs(ratio - 1) > DRIFT_THRESHOLD
                                               else "ok")])
    header = ["pipe", "stage", "GPU", "TP", "compute/mb ms", "P2P wait ms", "grad sync ms",
              "optimizer ms", f"within {DRIFT_THRESHOLD:.0%}"]
    lines = [f"measured iterations {first}-{last} ({path}"
             + (f"; {skipped} newer windows of other plans passed over" if skipped else "")
             + "): predicted / measured (ratio), compute per micro-batch (forward + backward), "
             "the other phases per iteration", format_table(header, rows)]
    iteration = window.get("iteration_s")
    predicted_iteration = (cost.iteration_time_s if cost is not None
                           else window.get("predicted_iteration_s"))
    if iteration is not None:
        lines.append(f"measured iteration {iteration:.4g} s (the slowest rank's median)"
                     + (f", predicted {predicted_iteration:.4g} s "
                        f"({iteration / predicted_iteration:.2f}x)" if predicted_iteration
                        else ""))
    return "\n".join(lines)


def check_figure_path(path: str) -> None:
    """A writable place and an image format matplotlib knows (ConfigError naming --figure)."""
    # matplotlib: not at `autohet` start-up
    from matplotlib.figure import Figure

    check_output_path(path, "--figure")
    formats = Figure().canvas.get_supported_filetypes()
    if Path(path).suffix.lstrip(".").lower() not in formats:
        raise ConfigError("<command line>", "--figure", f"{path}: unknown image format",
                          "a name ending in " + ", ".join(f".{f}" for f in sorted(formats)))


def plan_cluster(plan, args):
    """The plan's cluster (--cluster, else the bundled one of the plan's ``cluster:`` name),
    checked against the plan; None when none is known."""
    cluster_file = args.cluster or bundled_cluster_path(plan.cluster)
    if cluster_file is None:
        if args.profile:
            raise ConfigError("<command line>", "--profile", "needs the cluster to predict with",
                              f"--cluster (no bundled cluster is named {plan.cluster!r})")
        return None
    cluster = load_cluster(cluster_file, load_gpu_catalog(args.gpu_catalog))
    check_plan_on_cluster(plan, cluster, cluster_file)
    return cluster


def predict(plan, args, cluster=None):
    """PlanCost with timelines on ``cluster`` (default: :func:`plan_cluster`), or None when no
    cluster is known."""
    # pyscipopt: not at `autohet` start-up
    from megatron_autohet.planner.space import resolve_profile

    cluster = cluster or plan_cluster(plan, args)
    if cluster is None:
        return None
    profile = load_profiles(args.profile, plan.model.name)
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


def time_unit(seconds: float) -> tuple[float, str]:
    """(factor, unit) that write ``seconds`` with a few digits: s, ms or µs."""
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _time_axis(ax, seconds: float) -> tuple[float, str]:
    """The x axis in the unit of ``seconds`` (the iteration), ticks as plain numbers."""
    # matplotlib: not at `autohet` start-up
    from matplotlib.ticker import FuncFormatter

    factor, unit = time_unit(seconds)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * factor:.4g}"))
    ax.set_xlabel(f"time in the iteration ({unit})")
    return factor, unit


def node_zones(cluster) -> dict[str, str]:
    """Each node's zone on a cluster across zones; empty without zones (or without a cluster)."""
    if cluster is None or not cluster.regions:
        return {}
    return {n.name: n.zone for n in cluster.nodes}


def draw_plan(plan, cost, path, measured: dict | None = None,
              zones: dict[str, str] | None = None) -> None:
    """Write :func:`plan_figure` to ``path``."""
    # matplotlib: not at `autohet` start-up
    import matplotlib

    matplotlib.use("Agg")
    # after matplotlib.use: pyplot takes the file-only backend (no display needed)
    import matplotlib.pyplot as plt

    fig = plan_figure(plan, cost, measured, zones)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plan_figure(plan, cost, measured: dict | None = None, zones: dict[str, str] | None = None):
    """The figure described in the module docstring (without ``cost``: the plan panel; with a
    ``measured`` window, the panel of predicted and measured phases per stage). ``zones``
    (node -> zone, :func:`node_zones`; empty or None: a fleet without zones) marks the zones:
    each stage's box hatched by its zone and labelled with it, a legend of the zones' hatches,
    a red line where a pipeline's boundary crosses zones, the zone in each timeline row's name."""
    # matplotlib: not at `autohet` start-up
    import matplotlib

    matplotlib.use("Agg")
    # after matplotlib.use: pyplot takes the file-only backend (no display needed)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    gpus = list(dict.fromkeys(r.gpu for r in plan.ranks))
    colour = {g: PALETTE[i % len(PALETTE)] for i, g in enumerate(gpus)}
    zones = zones or {}
    used_zones = list(dict.fromkeys(zones[r.node] for r in plan.ranks)) if zones else []
    hatch = {z: ZONE_HATCHES[i % len(ZONE_HATCHES)] for i, z in enumerate(used_zones)}

    def zone_of(stage) -> str | None:
        return zones.get(plan.ranks[stage.ranks[0]].node)
    groups = identical_pipelines(cost) if cost is not None else []
    timeline_rows = sum(len(cost.pipelines[g[0]].stages) for g in groups)
    plan_height = 0.7 * len(plan.pipelines) + 1.0
    timeline_height = 0.28 * timeline_rows + 1.6 if cost is not None else 0.0
    stages = sum(len(pipe.stages) for pipe in plan.pipelines)
    measured_height = 0.5 * stages + 1.2 if measured is not None else 0.0
    heights = [h for h in (plan_height, timeline_height, measured_height) if h]
    fig = plt.figure(figsize=(13, sum(heights) + 0.8))
    axes = list(fig.subplots(len(heights), 1, gridspec_kw={"height_ratios": heights},
                             squeeze=False)[:, 0])
    ax_plan = axes.pop(0)
    ax_time = axes.pop(0) if cost is not None else None
    ax_measured = axes.pop(0) if measured is not None else None

    # -- the plan: pipelines as rows, stages as boxes spanning their layers ---------------------
    num_layers = plan.model.num_layers
    for p, pipe in enumerate(plan.pipelines):
        y = len(plan.pipelines) - 1 - p
        for s, stage in enumerate(pipe.stages):
            gpu = plan.ranks[stage.ranks[0]].gpu
            zone = zone_of(stage)
            label = f"L{chunk_ranges(stage)}\nTP{stage.tp} r{rank_list(stage.ranks)}"
            label += f"\n{zone}" if zone else ""
            for chunk_start, chunk_end in stage.chunks:     # a box per model chunk
                ax_plan.barh(y, chunk_end - chunk_start, left=chunk_start, height=0.8,
                             color=colour[gpu], edgecolor="black", linewidth=0.8,
                             hatch=hatch.get(zone))
                ax_plan.text((chunk_start + chunk_end) / 2, y, label, ha="center",
                             va="center", fontsize=7, color="white", clip_on=True)
            start = stage.layers[0]
            if s > 0 and zone != zone_of(pipe.stages[s - 1]):
                # this boundary's activations and gradients cross the zone link
                ax_plan.plot([start, start], [y - 0.45, y + 0.45], **ZONE_CROSSING_STYLE)
    ax_plan.set_yticks(range(len(plan.pipelines)))
    ax_plan.set_yticklabels([f"pipeline {p}\n{pipe.num_microbatches} mb"
                             + (f", v={pipe.virtual_stages}" if pipe.interleaved else "")
                             for p, pipe in reversed(list(enumerate(plan.pipelines)))], fontsize=8)
    ax_plan.set_xlim(0, num_layers)
    ax_plan.set_xlabel("transformer layer")
    ax_plan.set_title(f"{plan.model.name} on {plan.cluster}: {counted(plan.world_size, 'GPU')}, "
                      f"{counted(len(plan.pipelines), 'pipeline')}, global batch "
                      f"{plan.global_batch_size} (micro-batch {plan.micro_batch_size})",
                      fontsize=10)
    gpu_legend = ax_plan.legend(handles=[Patch(color=colour[g], label=g) for g in gpus],
                                loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                                title="GPU type", title_fontsize=8)
    if used_zones:
        ax_plan.add_artist(gpu_legend)
        ax_plan.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch=hatch[z],
                                      label=z) for z in used_zones]
                       + [Line2D([], [], **ZONE_CROSSING_STYLE, label="crosses zones")],
                       loc="lower left", bbox_to_anchor=(1.0, 0.0), fontsize=8, title="zone",
                       title_fontsize=8)

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
                ax_time.broken_barh(fwd, (y - 0.4, 0.8), facecolors=c, alpha=FORWARD_ALPHA,
                                    edgecolor="white", linewidth=0.3)
                ax_time.broken_barh(bwd, (y - 0.4, 0.8), facecolors=c, alpha=1.0,
                                    edgecolor="white", linewidth=0.3)
                # After the pipelines drain: this stage's gradient sync, then the optimizer step.
                ax_time.broken_barh([(cost.pipeline_time_s, scost.sync_s)], (y - 0.4, 0.8),
                                    facecolors=SYNC_STYLE["facecolor"],
                                    edgecolor=SYNC_STYLE["edgecolor"], hatch=SYNC_STYLE["hatch"],
                                    linewidth=0.3)
                ax_time.broken_barh([(cost.pipeline_time_s + cost.grad_sync_s,
                                      scost.optimizer_s)], (y - 0.4, 0.8),
                                    facecolors=OPTIMIZER_STYLE["facecolor"])
                zone = zone_of(plan.pipelines[members[0]].stages[s])
                labels.append((y, f"{name} s{s} {scost.gpu} TP{scost.tp}"
                               + (f" {zone}" if zone else "")))
                y -= 1
        ax_time.axvline(cost.pipeline_time_s, color="black", linestyle="--", linewidth=0.8)
        ax_time.axvline(cost.iteration_time_s, color="red", linestyle="-", linewidth=0.8)
        ax_time.set_yticks([t for t, _ in labels])
        ax_time.set_yticklabels([label for _, label in labels], fontsize=7)
        ax_time.set_ylim(-0.6, timeline_rows - 0.4)
        ax_time.set_xlim(0, cost.iteration_time_s * 1.02)
        factor, unit = _time_axis(ax_time, cost.iteration_time_s)
        ax_time.set_title(f"predicted 1F1B timeline: iteration "
                          f"{cost.iteration_time_s * factor:.3g} {unit}, "
                          f"{cost.tokens_per_s:,.0f} tokens/s", fontsize=10)
        first = colour[gpus[0]]
        ax_time.legend(handles=[
            Patch(facecolor=first, alpha=FORWARD_ALPHA, label="forward (light shade)"),
            Patch(facecolor=first, label="backward (full colour)"),
            Patch(**SYNC_STYLE, label="gradient sync"),
            Patch(**OPTIMIZER_STYLE, label="optimizer step"),
            Line2D([], [], color="black", linestyle="--", linewidth=0.8,
                   label="pipelines drained"),
            Line2D([], [], color="red", linewidth=0.8, label="iteration end")],
            loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if ax_measured is not None:
        _draw_measured(ax_measured, plan, cost, measured, Patch)
    fig.tight_layout()
    return fig


# one look per phase of runtime/stage_drift.py's PHASES
_PHASE_STYLES = {"compute": {"facecolor": "#4c72b0", "hatch": None, "edgecolor": "#4c72b0"},
                 "p2p_wait": {"facecolor": "#dd8452", "hatch": None, "edgecolor": "#dd8452"},
                 "grad_sync": SYNC_STYLE, "optimizer": OPTIMIZER_STYLE}


def _draw_measured(ax, plan, cost, window: dict, Patch) -> None:
    """Each stage's iteration as a rank spends it, predicted (upper bar) and measured (lower):
    compute of its micro-batches, P2P waits, gradient sync, optimizer step, one after the
    other (the predicted bar only as far as the plan predicts it)."""
    predicted, measured = predicted_phases(plan, cost), measured_phases(window)
    labels, y, longest = [], 2 * len(measured) - 1, 0.0
    for st, pred, meas in zip(window["stages"], predicted, measured):
        m = st["num_microbatches"]
        for kind, phases in (("predicted", pred), ("measured", meas)):
            left = 0.0
            for phase in PHASES:
                value = phases[phase]
                if value is None:
                    break
                width = value * m if phase == "compute" else value
                style = _PHASE_STYLES[phase]
                ax.broken_barh([(left, width)], (y - 0.4, 0.8), facecolors=style["facecolor"],
                               edgecolor=style["edgecolor"], hatch=style["hatch"], linewidth=0.3,
                               alpha=FORWARD_ALPHA if kind == "predicted" else 1.0)
                left += width
            longest = max(longest, left)
            labels.append((y, f"p{st['pipeline']} s{st['stage']} {st['gpu']} {kind}"))
            y -= 1
    first, last = window["window"]
    ax.set_yticks([t for t, _ in labels])
    ax.set_yticklabels([label for _, label in labels], fontsize=7)
    ax.set_ylim(-0.6, 2 * len(measured) - 0.4)
    _time_axis(ax, longest)
    ax.set_title(f"predicted (light) and measured (dark) phases per stage, iterations "
                 f"{first}-{last}", fontsize=10)
    ax.legend(handles=[Patch(**style, label=phase.replace("_", " "))
                       for phase, style in _PHASE_STYLES.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
