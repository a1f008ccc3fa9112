"""What the planning sub-commands (plan, compare, show) share: loading inputs, the plan table.

Everything a user passes is checked here before any search starts, so a mistake costs a second
and reads as ``autohet <cmd>: error: <file>: field '<f>': ...``, never as a traceback.
"""

from __future__ import annotations

from pathlib import Path

from megatron_autohet.cli._table import format_table
from megatron_autohet.cost_model import (CHARGES, DEFAULT_CHARGE, DEFAULT_MEMORY_HEADROOM,
                                         check_memory_headroom)
from megatron_autohet.errors import ConfigError, check_output_path, positive
from megatron_autohet.plan import DEFAULT_OBJECTIVE, OBJECTIVES
from megatron_autohet.profiling.profile import Profile, merge_profiles
from megatron_autohet.spec import load_cluster, load_gpu_catalog, load_model
from megatron_autohet.spec.gpus import CONFIG_DIR

RECOMPUTE_CHOICES = {"auto": None, "on": True, "off": False}


# ---- Megatron-LM's kernel-fusion flags, shared by train and profile ------------------------------

# megatron-core's fused kernels are on by default on CUDA GPUs where torch.compile works
# (runtime/fusions.py), never on a CPU; `autohet profile` takes the flags too, so a job trained
# unfused can be planned from a profile of the unfused layer.
FUSION_FLAGS = [
    (("--no-bias-gelu-fusion",), dict(
        action="store_true",
        help="GELU models: add the MLP's bias and apply its GELU unfused (exact GELU) "
             "instead of megatron-core's fused kernel (tanh GELU), as Megatron-LM's flag")),
    (("--no-bias-swiglu-fusion",), dict(
        action="store_true",
        help="SwiGLU models: the MLP's bias add and SwiGLU unfused, as Megatron-LM's flag")),
    (("--no-bias-dropout-fusion",), dict(
        action="store_true",
        help="bias add, dropout and residual add unfused, as Megatron-LM's flag")),
]


def requested_fusions(args) -> dict[str, bool]:
    """The fusions the flags leave on, as runtime/fusions.py's TransformerConfig fields."""
    return {"bias_activation_fusion": not (args.no_bias_gelu_fusion
                                           or args.no_bias_swiglu_fusion),
            "bias_dropout_fusion": not args.no_bias_dropout_fusion}


def check_activation_fusion_flag(args, model) -> None:
    """The bias + activation fusion flag must be the model's (Megatron-LM ignores the other; a
    flag that does nothing is refused here)."""
    flags = {"--no-bias-gelu-fusion": args.no_bias_gelu_fusion,
             "--no-bias-swiglu-fusion": args.no_bias_swiglu_fusion}
    wanted = "--no-bias-swiglu-fusion" if model.gated_linear_unit else "--no-bias-gelu-fusion"
    for flag, given in flags.items():
        if given and flag != wanted:
            mlp = "SwiGLU" if model.gated_linear_unit else "GELU"
            raise ConfigError("<command line>", flag, f"the model's MLP is {mlp}", wanted)


# ---- arguments shared by plan and compare --------------------------------------------------------

def add_planning_arguments(parser) -> None:
    parser.add_argument("--cluster", required=True, metavar="C.yaml",
                        help="cluster file: nodes, GPU types, bandwidths (configs/clusters/)")
    parser.add_argument("--model", required=True, metavar="M.yaml",
                        help="model file: GPT dimensions (configs/models/)")
    parser.add_argument("--profile", **PROFILE_ARGUMENT)
    parser.add_argument("--gpu-catalog", default=None, metavar="G.yaml",
                        help="GPU catalog (default: the bundled configs/gpus.yaml)")
    parser.add_argument("--global-batch-size", type=int, required=True, metavar="N",
                        help="sequences per iteration, over all pipelines")
    parser.add_argument("--micro-batch-size", type=int, default=1, metavar="B",
                        help="sequences per micro-batch; must divide the global batch (default: 1)")
    parser.add_argument("--seq-length", type=int, default=None, metavar="S",
                        help="tokens per sequence (default: the model's seq_length)")
    parser.add_argument("--allow-asymmetric-tp", action="store_true",
                        help="let GPU types use different TP degrees (replicas then hold a layer "
                             "at different TP degrees and the gradient sync re-shards; "
                             "default: one TP degree for the whole fleet)")
    parser.add_argument("--recompute", choices=sorted(RECOMPUTE_CHOICES), default="auto",
                        help="full activation recompute: 'auto' turns it on only where memory "
                             "needs it (default: auto)")
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="SECONDS",
                        help="wall-clock safety net of the search (default: 60); the search's "
                             "budget is counted in work (SCIP nodes), so the same input gives "
                             "the same plan on any machine unless this limit cuts it, which "
                             "the output then says")
    parser.add_argument("--objective", choices=OBJECTIVES, default=DEFAULT_OBJECTIVE,
                        help="throughput: the shortest iteration; cost: the fewest USD per "
                             "million tokens from the nodes' spot_price (USD per GPU-hour, "
                             "needed on every node) among the plans that reach a throughput "
                             "floor (--min-tokens-per-s, or --deadline-hours with "
                             "--train-tokens; one is required), possibly leaving expensive, "
                             "slow nodes idle (default: throughput)")
    parser.add_argument("--min-tokens-per-s", type=float, default=None, metavar="X",
                        help="with --objective cost: the plan must train at least X tokens/s")
    parser.add_argument("--deadline-hours", type=float, default=None, metavar="H",
                        help="with --objective cost and --train-tokens: the plan must train "
                             "them within H hours (a floor of T / 3600 H tokens/s)")
    parser.add_argument("--train-tokens", type=float, default=None, metavar="T",
                        help="tokens the job trains (e.g. 3e10): the output adds each plan's "
                             "time and, with prices, USD to train them; the deadline's tokens")
    parser.add_argument("--charge", choices=CHARGES, default=None,
                        help="how prices are charged: per-node, every GPU of every node a plan "
                             "uses (spot capacity is rented by the node, a partly used node is "
                             "paid whole); per-gpu, only the GPUs holding a rank (fleets that "
                             "rent single GPUs); needs spot_price on every node (default: "
                             f"{DEFAULT_CHARGE})")
    parser.add_argument("--memory-headroom", type=float, default=DEFAULT_MEMORY_HEADROOM,
                        metavar="FRACTION",
                        help="fraction of every GPU's memory a plan leaves free for the "
                             "allocator's fragmentation (default: "
                             f"{DEFAULT_MEMORY_HEADROOM})")
    parser.add_argument("--no-virtual-stages", action="store_true",
                        help="keep one model chunk per stage: by default the pipelines that set "
                             "the iteration time get 2 or 4 (megatron-core's interleaved 1F1B, "
                             "Megatron-LM's --num-layers-per-virtual-pipeline-stage) where the "
                             "cost model prices a gain")


# --profile of plan, compare, show and replan: given several times, the files are merged.
PROFILE_ARGUMENT = dict(
    action="append", default=None, metavar="P.yaml",
    help="profile from `autohet profile` or a job's --autohet-measured-profile; entries it "
         "lacks are estimated; several are merged, per GPU type, TP degree, micro-batch size "
         "and sequence length the most measured entry (then the first given) "
         "(default: analytic estimates from the GPU catalog only)")


def load_profile(path: str, model_name: str):
    """The profile file at ``path``, made for the model ``model_name``."""
    profile = Profile.load(path)
    if profile.model != model_name:
        raise ConfigError(path, "model", f"profile is for {profile.model!r}, the model is "
                          f"{model_name!r}", f"a profile of {model_name!r}")
    return profile


def load_profiles(paths: list[str] | None, model_name: str):
    """The ``--profile`` files (None: none given) as one profile (profiling/profile.py
    ``merge_profiles``: a measured entry wins over an estimate), each made for ``model_name``."""
    if not paths:
        return None
    profiles = [load_profile(path, model_name) for path in paths]
    return profiles[0] if len(profiles) == 1 else merge_profiles(profiles, list(paths))


def load_planning_inputs(args):
    """(cluster, model, profile or None) from the shared arguments, cross-checked."""
    for flag, value in (("--global-batch-size", args.global_batch_size),
                        ("--micro-batch-size", args.micro_batch_size),
                        ("--seq-length", args.seq_length), ("--time-limit", args.time_limit),
                        ("--min-tokens-per-s", args.min_tokens_per_s),
                        ("--deadline-hours", args.deadline_hours),
                        ("--train-tokens", args.train_tokens)):
        positive(value, flag)
    throughput_floor(args)
    if args.global_batch_size % args.micro_batch_size:
        raise ConfigError("<command line>", "--global-batch-size",
                          f"{args.global_batch_size} is not a multiple of --micro-batch-size "
                          f"{args.micro_batch_size}", "a multiple of the micro-batch size")
    check_output_path(args.output, "--output")
    catalog = load_gpu_catalog(args.gpu_catalog)
    cluster = load_cluster(args.cluster, catalog)
    model = load_model(args.model)
    for t in getattr(args, "tp", None) or []:
        model.check_tp_degree(t, "<command line>", "--tp")
    if args.seq_length is not None:
        model.check_seq_length(args.seq_length, "<command line>", "--seq-length")
    profile = load_profiles(args.profile, model.name)
    # pyscipopt: not at `autohet` start-up
    from megatron_autohet.planner.cost_search import check_prices
    from megatron_autohet.planner.objective import objective_named

    priced = objective_named(args.objective).priced
    if priced or args.charge is not None:
        check_prices(cluster, args.cluster, f"--objective {args.objective}" if priced
                     else "--charge")
    return cluster, model, profile


def throughput_floor(args) -> float | None:
    """The cost objective's floor in tokens/s from --min-tokens-per-s or --deadline-hours and
    --train-tokens (None with the throughput objective); every combination that would leave a
    flag without effect, or the cost objective without a floor, is an error."""
    # pyscipopt: not at `autohet` start-up
    from megatron_autohet.planner.objective import floor_objectives, objective_named

    floored = " or ".join(f"--objective {name}" for name in floor_objectives())
    if args.deadline_hours is not None and args.train_tokens is None:
        raise ConfigError("<command line>", "--deadline-hours", "no --train-tokens: the "
                          "deadline is for training that many tokens", "with --train-tokens T")
    if args.min_tokens_per_s is not None and args.deadline_hours is not None:
        raise ConfigError("<command line>", "--min-tokens-per-s", "given with --deadline-hours",
                          "one throughput floor: --min-tokens-per-s X, or --deadline-hours H "
                          "with --train-tokens T")
    given = "--min-tokens-per-s" if args.min_tokens_per_s is not None else (
        "--deadline-hours" if args.deadline_hours is not None else None)
    if not objective_named(args.objective).takes_floor:
        if given:
            raise ConfigError("<command line>", given, f"without {floored} (the throughput "
                              "objective's plan is the fastest anyway)", f"with {floored}")
        return None
    if given is None:
        raise ConfigError("<command line>", "--objective", f"{args.objective} without a "
                          "throughput floor: the cheapest plan would train on a few GPUs for as "
                          "long as it takes",
                          "with --min-tokens-per-s X, or --deadline-hours H and --train-tokens T")
    if args.min_tokens_per_s is not None:
        return args.min_tokens_per_s
    return args.train_tokens / (3600 * args.deadline_hours)


def floor_error(args, exc) -> ConfigError:
    """A planner.cost_search.FloorNotMet in the words of the flag that set the floor."""
    fastest = exc.fastest_tokens_per_s
    if args.deadline_hours is None:
        return ConfigError("<command line>", "--min-tokens-per-s",
                           f"{args.min_tokens_per_s:,.0f} tokens/s is more than the fastest "
                           f"plan found reaches ({fastest:,.0f})",
                           f"at most {fastest:,.0f}, or more GPUs")
    hours = args.train_tokens / fastest / 3600
    return ConfigError("<command line>", "--deadline-hours",
                       f"{format_tokens(args.train_tokens)} tokens in "
                       f"{args.deadline_hours:g} h need {throughput_floor(args):,.0f} tokens/s; "
                       f"the fastest plan found reaches {fastest:,.0f} ({format_hours(hours)})",
                       f"at least {format_hours(hours)}, fewer tokens, or more GPUs")


def counted(n: int, noun: str) -> str:
    """``n`` and the noun, plural unless n is 1: "1 pipeline", "4 pipelines"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_hours(hours: float) -> str:
    return f"{hours:,.3g} h" if hours < 48 else f"{hours / 24:,.3g} days"


def format_tokens(tokens: float) -> str:
    """3e10, not 3e+10: as the flags take it."""
    return f"{tokens:.4g}".replace("e+", "e")


def planning_options(args) -> dict:
    """Keyword arguments of planner.search / compare from the shared arguments."""
    return {"allow_asymmetric_tp": args.allow_asymmetric_tp,
            "activation_recompute": RECOMPUTE_CHOICES[args.recompute],
            "time_limit_s": args.time_limit, "objective": args.objective,
            "memory_headroom": check_memory_headroom(args.memory_headroom),
            "min_tokens_per_s": throughput_floor(args),
            "charge": args.charge or DEFAULT_CHARGE,
            "virtual_stages": not args.no_virtual_stages}


# ---- plans against clusters ----------------------------------------------------------------------

def bundled_cluster_path(name: str) -> Path | None:
    path = CONFIG_DIR / "clusters" / f"{name}.yaml"
    return path if path.is_file() else None


def check_plan_on_cluster(plan, cluster, cluster_file) -> None:
    """Every rank of the plan is a GPU of this cluster (same node, local index and type); GPUs
    the plan leaves idle have no rank."""
    if plan.cluster != cluster.name:
        raise ConfigError(cluster_file, "name", f"cluster {cluster.name!r}, the plan was made "
                          f"for {plan.cluster!r}", f"the cluster the plan was made for "
                          f"({plan.cluster!r})")
    devices = {(d.node, d.local_rank): d for d in cluster.devices()}
    for info in plan.ranks:
        device = devices.get((info.node, info.local_rank))
        if device is None or device.gpu != info.gpu:
            found = "no such GPU" if device is None else f"a {device.gpu}"
            raise ConfigError(cluster_file, "nodes", f"rank {info.rank} is {info.gpu} GPU "
                              f"{info.local_rank} of node {info.node} in the plan, the cluster "
                              f"has {found} there", f"the cluster the plan was made for "
                              f"({plan.cluster!r})")


# ---- output --------------------------------------------------------------------------------------

def rank_list(ranks) -> str:
    """'0-3' for consecutive ranks, else '0,2,5'."""
    ranks = list(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def layer_range(layers) -> str:
    """Inclusive layer numbers of a half-open range: (6, 11) -> '6-10', (0, 1) -> '0'."""
    start, end = layers
    return str(start) if end - start == 1 else f"{start}-{end - 1}"


def chunk_ranges(stage) -> str:
    """A stage's layers as :func:`layer_range` writes them, one range per model chunk of an
    interleaved pipeline: '0-1,3-4'."""
    return ",".join(layer_range(chunk) for chunk in stage.chunks)


def format_plan_table(plan, cost=None, cluster=None) -> str:
    """Pipelines x stages. Time and memory come from ``cost`` (a PlanCost) when given, else from
    the predictions stored in the plan file. A "warm-up" column (the 1F1B warm-up depth each
    stage runs) appears when some stage's depth is not the standard one, a "zone" column (each
    stage's node's) when ``cluster`` is across zones."""
    header = ["pipe", "stage", "ranks", "node", "GPU", "TP", "layers", "micro-batches",
              "time/mb ms", "memory GiB"]
    with_warmup = any(pipe.warmup_depths() != pipe.standard_warmup_depths()
                      for pipe in plan.pipelines)
    if with_warmup:
        header.insert(8, "warm-up")
    with_zones = cluster is not None and bool(cluster.regions)
    if with_zones:
        header.insert(4, "zone")
    rows = []
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            info = plan.ranks[stage.ranks[0]]
            if cost is not None:
                sc = cost.pipelines[p].stages[s]
                time_s = sc.time_s
                memory = f"{sc.memory_gib:.1f} / {sc.memory_limit_gib:.0f}"
                if not sc.fits:
                    memory += " OVER"
            else:
                time_s = stage.predicted_time_s
                memory = ("-" if stage.predicted_memory_gib is None
                          else f"{stage.predicted_memory_gib:.1f}")
            row = [p if s == 0 else "", s, rank_list(stage.ranks), info.node, info.gpu,
                   stage.tp, chunk_ranges(stage), pipe.num_microbatches if s == 0 else "",
                   "-" if time_s is None else f"{time_s * 1e3:.3g}", memory]
            if with_warmup:
                row.insert(8, pipe.warmup_depths()[s])
            if with_zones:
                row.insert(4, cluster.node(info.node).zone)
            rows.append(row)
    return format_table(header, rows)


def format_idle(idle_gpus: dict[str, int]) -> str:
    """GPUs a plan leaves unused, per type ("none" when it uses all)."""
    return ", ".join(f"{n} x {gpu}" for gpu, n in idle_gpus.items()) or "none"


def format_prediction(plan, cost=None, train_tokens: float | None = None) -> str:
    """One paragraph: iteration time, tokens/s and their parts; with ``train_tokens``, the time
    (and price) to train them."""
    # pyscipopt: not at `autohet` start-up
    from megatron_autohet.planner.objective import objective_of

    if cost is not None:
        predicted = cost.predicted()
    else:
        predicted = plan.predicted
    if not predicted:
        return "no prediction stored in the plan (pass --cluster to compute one)"
    lines = [f"predicted iteration time {predicted['iteration_time_s']:.4g} s, "
             f"{predicted['tokens_per_s']:,.0f} tokens/s "
             f"(global batch {plan.global_batch_size} x seq {plan.seq_length}, micro-batch "
             f"{plan.micro_batch_size}, activation recompute "
             f"{'on' if plan.activation_recompute else 'off'}"
             + (", distributed optimizer" if plan.use_distributed_optimizer else "") + ")"]
    if "pipeline_time_s" in predicted:
        lines.append(f"  = pipelines {predicted['pipeline_time_s']:.4g} s + gradient sync "
                     f"{predicted['grad_sync_s']:.4g} s + optimizer "
                     f"{predicted['optimizer_s']:.4g} s; "
                     f"peak memory {predicted['peak_memory_gib']:.1f} GiB"
                     + ("" if predicted.get("fits_memory", True) else " (DOES NOT FIT)"))
    if predicted.get("idle_gpus"):
        lines.append(f"  idle GPUs (no rank in this plan): {format_idle(predicted['idle_gpus'])}")
    usd = predicted.get("usd_per_million_tokens")
    if usd is not None:
        charge = predicted.get("charge", DEFAULT_CHARGE)
        lines.append(f"  price: ${usd:.4g} per million tokens, "
                     + (f"${predicted['usd_per_hour']:,.4g} per hour " if "usd_per_hour" in
                        predicted else "")
                     + ("(spot prices of every GPU of the nodes used, idle ones included: "
                        "--charge per-node)" if charge == "per-node" else
                        "(spot prices of the GPUs used: --charge per-gpu)")
                     + (f" + ${predicted['egress_usd_per_iteration']:.4g} of egress per "
                        "iteration (bytes crossing zones)"
                        if "egress_usd_per_iteration" in predicted else ""))
    said = objective_of(plan).describe(predicted)
    if said is not None:
        lines.append(f"  objective: {said}; its re-plans keep it")
    if train_tokens is not None:
        hours = train_tokens / predicted["tokens_per_s"] / 3600
        lines.append(f"  {format_tokens(train_tokens)} tokens train in {format_hours(hours)}"
                     + ("" if usd is None else f" for ${usd * train_tokens / 1e6:,.0f}"))
    if predicted.get("profile_sources"):
        lines.append("  stage costs from: " + "; ".join(
            f"{key} " + "/".join(dict.fromkeys(parts.values()))
            for key, parts in predicted["profile_sources"].items()))
    return "\n".join(lines)


def print_cut_warning(cand, time_limit_s: float) -> None:
    """One WARNING line when the safety net, not the work budget, ended the search: its plan
    then depends on the machine's speed and load, so the line names the flag that lets the
    work budget decide."""
    # pyscipopt: not at `autohet` start-up
    from megatron_autohet.planner.candidate import STOP_TIME

    if cand.stopped_by == STOP_TIME:
        print(f"> WARNING: --time-limit {time_limit_s:g} s cut the search before its work "
              "budget ended it (a slow or loaded machine): the plan may differ on another "
              f"machine or at another load; raise --time-limit (e.g. {4 * time_limit_s:g}) "
              "for the plan the work budget decides")


def search_end(cand) -> str:
    """How the search that found ``cand`` ended, in words."""
    # pyscipopt: not at `autohet` start-up
    from megatron_autohet.planner.candidate import STOP_SETS, STOP_TIME, STOP_WORK

    if cand.stopped_by == STOP_TIME:
        return ("cut by --time-limit before its work budget: the plan may differ on a faster "
                "or idle machine")
    if cand.stopped_by == STOP_SETS:
        return ("budget of throughput searches (node sets, or GPU types and TP degrees) spent "
                f"before the cheapest was proven, {cand.work} SCIP nodes")
    if cand.stopped_by == STOP_WORK:
        return f"work budget of {cand.work} SCIP nodes spent"
    return f"complete, {cand.work} SCIP nodes"
