"""The plan: the contract between the planner and the runtime.

A plan says, for a given cluster and model, which global ranks form each stage's tensor-parallel
group, how stages chain into pipelines (data-parallel replicas of possibly different shapes), which
layers each stage holds and how many micro-batches each pipeline processes per iteration.

File form (``plan.yaml``)::

    format_version: 1
    cluster: a100-h800-h20
    model: {name: gpt3-1.3b, num_layers: 24, hidden_size: 2048, ...}   # full ModelSpec
    micro_batch_size: 1
    global_batch_size: 64          # = micro_batch_size * sum(num_microbatches)
    seq_length: 2048
    activation_recompute: false
    use_distributed_optimizer: true   # optional (default false): planned for, and trained with,
                                      # Adam state sharded over each parameter's holders
    overlap_grad_reduce: true      # optional (default false): priced and trained with each
                                   # gradient bucket synced during the backward
    ranks:                         # index i describes global rank i
      - {rank: 0, node: a100, local_rank: 0, gpu: A100-80GB}
    pipelines:
      - num_microbatches: 40
        virtual_stages: 1          # optional (default 1): model chunks per stage (interleaved
                                   # 1F1B when > 1; see "Interleaved pipelines" below)
        stages:
          - ranks: [0, 1]          # TP group, in TP-rank order
            layers: [0, 12]        # global layer indices, half-open [start, end)
            warmup_microbatches: 3 # optional: 1F1B warm-up depth (default num_stages - index - 1;
                                   # non-increasing along the pipeline, 0 on the last stage)
            predicted_time_s: 0.021      # optional: forward+backward of one micro-batch
            predicted_memory_gib: 31.2   # optional: peak memory of one GPU of the stage
    predicted: {iteration_time_s: 1.93, tokens_per_s: 67900, memory_headroom: 0.1}   # optional
    profile: {model: gpt3-1.3b, entries: [...]}  # optional: the profile it was priced on (a
                                   # profile file's mapping; none: the analytic estimates), which
                                   # its re-plans price on too
    objective: cost                # optional (default throughput: the fastest plan): the cheapest
    min_tokens_per_s: 20000.0      # plan reaching this throughput floor; its re-plans keep both

The first stage of each pipeline also holds the embedding, the last one the output layer and loss.
Loading validates everything; a bad plan is a :class:`ConfigError` naming the field.

Interleaved pipelines (megatron-core's interleaved 1F1B, Megatron-LM's
``--num-layers-per-virtual-pipeline-stage``): a pipeline with ``virtual_stages: v > 1`` cuts the
model into ``v * n`` model chunks over its ``n`` stages, and each stage lists the layer range of
each of its ``v`` chunks, ``layers: [[0, 2], [4, 6]]``. Chunk ``c`` of stage ``s`` is virtual
stage ``c * n + s``, and the virtual stages cover the layers in that order (stage 0's first chunk
from layer 0, the last stage's last chunk to the end): megatron's own layout order, which also
sets each chunk's layer offset. Chunks may differ in size (megatron's
``--pipeline-model-parallel-layout`` allows it), each holds at least one layer. What megatron's
interleaved schedule needs besides (``forward_backward_pipelining_with_interleaving``, its micro-
batch groups of the default size ``n``): at least 2 stages and ``num_microbatches`` a multiple of
``n``. Its warm-up depth is computed from the stage's true position, ``2 (n - s - 1) + (v - 1) n``,
which also decides which chunk runs which micro-batch, so an interleaved pipeline takes no
``warmup_microbatches``. Pipelines of one plan may differ in ``v`` (each runs its own schedule;
their gradients meet only in the layer-wise sync after it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from megatron_autohet.errors import ConfigError
from megatron_autohet.spec._yaml import check_keys, get_field, read_yaml_mapping
from megatron_autohet.spec.cluster import trains_in
from megatron_autohet.spec.gpus import GPUType
from megatron_autohet.spec.model import ModelSpec, model_from_dict

FORMAT_VERSION = 1
# What a plan is chosen for, by the name its file records (planner/objective.py has a class for
# each): the shortest iteration (the default), or the fewest USD per million tokens among the
# plans reaching a throughput floor; and those that take that floor (min_tokens_per_s). The
# file's vocabulary, which `autohet plan --objective` offers too.
OBJECTIVES = ("throughput", "cost")
DEFAULT_OBJECTIVE = OBJECTIVES[0]
FLOOR_OBJECTIVES = ("cost",)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: str
    local_rank: int
    gpu: str


@dataclass
class Stage:
    ranks: list[int]
    layers: tuple[int, int]                  # [start, end); in an interleaved pipeline chunk 0's
    warmup_microbatches: int | None = None
    predicted_time_s: float | None = None
    predicted_memory_gib: float | None = None
    # The [start, end) of model chunks 1..v-1 in an interleaved pipeline (module doc); () else.
    virtual_layers: tuple[tuple[int, int], ...] = ()

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """The layer range of each of the stage's model chunks, in chunk order."""
        return (tuple(self.layers),) + tuple(tuple(c) for c in self.virtual_layers)

    @property
    def num_layers(self) -> int:
        return sum(end - start for start, end in self.chunks)

    def layers_label(self, end_inclusive: bool = False) -> str:
        """Its layers as text, ``start-end`` per model chunk joined by ``+`` (``0-2+4-6``)."""
        return "+".join(f"{start}-{end - end_inclusive}" for start, end in self.chunks)


def standard_warmup_depths(num_stages: int, num_microbatches: int) -> list[int]:
    """Megatron's 1F1B warm-up depth per stage: num_stages - s - 1, at most the micro-batches."""
    return [min(num_stages - s - 1, num_microbatches) for s in range(num_stages)]


@dataclass
class Pipeline:
    stages: list[Stage]
    num_microbatches: int
    virtual_stages: int = 1          # model chunks per stage: > 1 runs interleaved 1F1B

    @property
    def ranks(self) -> list[int]:
        return [r for s in self.stages for r in s.ranks]

    @property
    def interleaved(self) -> bool:
        return self.virtual_stages > 1

    def virtual_stage_layers(self) -> list[tuple[int, int]]:
        """The layer range of every model chunk in model order: virtual stage c * n + s is chunk
        c of stage s (megatron's layout order)."""
        return [stage.chunks[c] for c in range(self.virtual_stages) for stage in self.stages]

    def standard_warmup_depths(self) -> list[int]:
        return standard_warmup_depths(len(self.stages), self.num_microbatches)

    def warmup_depths(self) -> list[int]:
        """Effective 1F1B warm-up depth per stage: the plan's, or the standard one."""
        return [standard if stage.warmup_microbatches is None else stage.warmup_microbatches
                for stage, standard in zip(self.stages, self.standard_warmup_depths())]


@dataclass
class Plan:
    cluster: str
    model: ModelSpec
    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    ranks: list[RankInfo]
    pipelines: list[Pipeline]
    activation_recompute: bool = False
    # Planned for Megatron-LM's --use-distributed-optimizer (Adam state sharded over each
    # parameter's holders): the cost model prices it, the runtime trains with it.
    use_distributed_optimizer: bool = False
    # Planned for Megatron-LM's --overlap-grad-reduce (each gradient bucket synced during the
    # last micro-batch's backward, runtime/grad_sync.py): the cost model prices the overlap,
    # the runtime trains with it.
    overlap_grad_reduce: bool = False
    predicted: dict = field(default_factory=dict)
    # The profile file's mapping the plan was priced on (None: analytic estimates); read as a
    # profile by cost_model.plan_profile, where the layers that know profiles are.
    profile: dict | None = None
    # The objective the planner chose it for (OBJECTIVES) and the cost objective's floor (None:
    # none); recorded so that its re-plans, made without `autohet plan`'s flags, keep them.
    objective: str = DEFAULT_OBJECTIVE
    min_tokens_per_s: float | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_microbatches_total(self) -> int:
        return sum(p.num_microbatches for p in self.pipelines)

    def validate(self, file: str | Path = "<plan>") -> "Plan":
        validate_plan(self, file)
        return self

    # ---- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        def stage_dict(s: Stage) -> dict:
            layers = ([[a, b] for a, b in s.chunks] if s.virtual_layers
                      else [s.layers[0], s.layers[1]])
            d = {"ranks": list(s.ranks), "layers": layers}
            for key in ("warmup_microbatches", "predicted_time_s", "predicted_memory_gib"):
                if getattr(s, key) is not None:
                    d[key] = getattr(s, key)
            return d

        return {
            "format_version": FORMAT_VERSION,
            "cluster": self.cluster,
            "model": self.model.to_dict(),
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length,
            "activation_recompute": self.activation_recompute,
            # written only when set: a plan without it keeps its old file (and checkpoint) form
            **({"use_distributed_optimizer": True} if self.use_distributed_optimizer else {}),
            **({"overlap_grad_reduce": True} if self.overlap_grad_reduce else {}),
            "ranks": [asdict(r) for r in self.ranks],
            # virtual_stages written only when > 1: a plain pipeline keeps its old file form
            "pipelines": [{"num_microbatches": p.num_microbatches,
                           **({"virtual_stages": p.virtual_stages} if p.interleaved else {}),
                           "stages": [stage_dict(s) for s in p.stages]} for p in self.pipelines],
            "predicted": dict(self.predicted),
            **({"profile": self.profile} if self.profile is not None else {}),
            # written only for another objective than the default: a throughput plan keeps its
            # old file form
            **({"objective": self.objective} if self.objective != DEFAULT_OBJECTIVE else {}),
            **({"min_tokens_per_s": self.min_tokens_per_s}
               if self.min_tokens_per_s is not None else {}),
        }

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None))
        tmp.replace(path)


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    return plan_from_dict(read_yaml_mapping(path), path)


_PLAN_FIELDS = {"format_version", "cluster", "model", "micro_batch_size", "global_batch_size",
                "seq_length", "activation_recompute", "use_distributed_optimizer",
                "overlap_grad_reduce", "ranks", "pipelines", "predicted", "profile", "objective",
                "min_tokens_per_s"}
_STAGE_FIELDS = {"ranks", "layers", "warmup_microbatches", "predicted_time_s",
                 "predicted_memory_gib"}


def plan_from_dict(data: dict, file: str | Path = "<plan>") -> Plan:
    check_keys(data, _PLAN_FIELDS, file, "")
    version = get_field(data, "format_version", int, file, default=FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ConfigError(file, "format_version", f"got {version}", str(FORMAT_VERSION))
    model_raw = get_field(data, "model", dict, file)
    try:
        model = model_from_dict(model_raw, file)
    except ConfigError as exc:
        raise ConfigError(file, f"model.{exc.field}", exc.problem, exc.allowed) from None
    ranks = []
    for i, raw in enumerate(get_field(data, "ranks", list, file)):
        where = f"ranks[{i}]"
        if not isinstance(raw, dict):
            raise ConfigError(file, where, f"expected a mapping, got {raw!r}")
        check_keys(raw, {"rank", "node", "local_rank", "gpu"}, file, where)
        ranks.append(RankInfo(rank=get_field(raw, "rank", int, file, where, min_value=0),
                              node=get_field(raw, "node", str, file, where),
                              local_rank=get_field(raw, "local_rank", int, file, where,
                                                   min_value=0),
                              gpu=get_field(raw, "gpu", str, file, where)))
    pipelines = []
    for p, raw in enumerate(get_field(data, "pipelines", list, file)):
        where = f"pipelines[{p}]"
        if not isinstance(raw, dict):
            raise ConfigError(file, where, f"expected a mapping, got {raw!r}")
        check_keys(raw, {"num_microbatches", "virtual_stages", "stages"}, file, where)
        virtual_stages = get_field(raw, "virtual_stages", int, file, where, default=1,
                                   positive=True)
        stages = []
        for s, sraw in enumerate(get_field(raw, "stages", list, file, where)):
            swhere = f"{where}.stages[{s}]"
            if not isinstance(sraw, dict):
                raise ConfigError(file, swhere, f"expected a mapping, got {sraw!r}")
            check_keys(sraw, _STAGE_FIELDS, file, swhere)
            stage_ranks = get_field(sraw, "ranks", list, file, swhere)
            if not stage_ranks or not all(isinstance(r, int) and not isinstance(r, bool)
                                          for r in stage_ranks):
                raise ConfigError(file, f"{swhere}.ranks", f"got {stage_ranks!r}",
                                  "a non-empty list of global ranks")
            chunks = _stage_chunks(get_field(sraw, "layers", list, file, swhere),
                                   virtual_stages, file, f"{swhere}.layers")
            stages.append(Stage(
                ranks=list(stage_ranks), layers=chunks[0], virtual_layers=tuple(chunks[1:]),
                warmup_microbatches=get_field(sraw, "warmup_microbatches", int, file, swhere,
                                              default=None, min_value=0),
                predicted_time_s=get_field(sraw, "predicted_time_s", float, file, swhere,
                                           default=None),
                predicted_memory_gib=get_field(sraw, "predicted_memory_gib", float, file, swhere,
                                               default=None)))
        pipelines.append(Pipeline(stages=stages, num_microbatches=get_field(
            raw, "num_microbatches", int, file, where, positive=True),
            virtual_stages=virtual_stages))
    plan = Plan(
        cluster=get_field(data, "cluster", str, file),
        model=model,
        micro_batch_size=get_field(data, "micro_batch_size", int, file, positive=True),
        global_batch_size=get_field(data, "global_batch_size", int, file, positive=True),
        seq_length=get_field(data, "seq_length", int, file, positive=True),
        ranks=ranks,
        pipelines=pipelines,
        activation_recompute=get_field(data, "activation_recompute", bool, file, default=False),
        use_distributed_optimizer=get_field(data, "use_distributed_optimizer", bool, file,
                                            default=False),
        overlap_grad_reduce=get_field(data, "overlap_grad_reduce", bool, file, default=False),
        predicted=get_field(data, "predicted", dict, file, default={}),
        profile=get_field(data, "profile", dict, file, default=None),
        objective=get_field(data, "objective", str, file, default=DEFAULT_OBJECTIVE),
        min_tokens_per_s=get_field(data, "min_tokens_per_s", float, file, default=None),
    )
    if "memory_headroom" in plan.predicted:      # the planner's, read back by show and replan
        headroom = get_field(plan.predicted, "memory_headroom", float, file, "predicted",
                             min_value=0.0)
        if headroom >= 1.0:
            raise ConfigError(file, "predicted.memory_headroom", f"got {headroom!r}",
                              "a fraction of GPU memory in [0, 1)")
        plan.predicted["memory_headroom"] = headroom
    return plan.validate(file)


def _is_range(x) -> bool:
    return (isinstance(x, list) and len(x) == 2
            and all(isinstance(i, int) and not isinstance(i, bool) for i in x))


def _stage_chunks(layers: list, virtual_stages: int, file: str | Path, where: str
                  ) -> list[tuple[int, int]]:
    """A stage's ``layers`` field as one [start, end) per model chunk: ``[s, e]`` in a plain
    pipeline, a list of ``virtual_stages`` such pairs in an interleaved one (module doc)."""
    if virtual_stages == 1:
        if not _is_range(layers):
            raise ConfigError(file, where, f"got {layers!r}",
                              "[start, end): two integers, end exclusive")
        return [(layers[0], layers[1])]
    if len(layers) != virtual_stages or not all(_is_range(c) for c in layers):
        raise ConfigError(file, where, f"got {layers!r} in a pipeline of virtual_stages "
                          f"{virtual_stages}", f"{virtual_stages} [start, end) pairs, one per "
                          "model chunk: [[s0, e0], [s1, e1], ...]")
    return [(c[0], c[1]) for c in layers]


def _validate_interleaving(pipe: Pipeline, where: str, file: str | Path) -> None:
    """What megatron-core's interleaved 1F1B needs of a pipeline with virtual stages (module
    doc): >= 2 stages, micro-batches in whole groups of n, its own warm-up depths."""
    n, v, m = len(pipe.stages), pipe.virtual_stages, pipe.num_microbatches
    if n < 2:
        raise ConfigError(file, f"{where}.virtual_stages", f"{v} on a pipeline of 1 stage",
                          "1: megatron's interleaved schedule needs at least 2 stages")
    if m % n:
        raise ConfigError(file, f"{where}.num_microbatches",
                          f"{m} with virtual_stages {v} over {n} stages",
                          f"a multiple of {n}: megatron's interleaved schedule runs micro-batches "
                          f"in groups of the pipeline's {n} stages")
    for s, stage in enumerate(pipe.stages):
        if stage.warmup_microbatches is not None:
            raise ConfigError(file, f"{where}.stages[{s}].warmup_microbatches",
                              f"{stage.warmup_microbatches} in a pipeline of virtual_stages {v}",
                              "none: megatron's interleaved schedule derives its warm-up from "
                              "the stage's position, which also orders its chunks")


def _validate_warmup(pipe: Pipeline, where: str, file: str | Path) -> None:
    """Warm-up depths the runtime's 1F1B can run without deadlock (proof: runtime/p2p.py).

    A stage may run ahead of the next one (HAPT: stages before a slow link), never behind it:
    a stage with a deeper warm-up than its predecessor waits for an activation the predecessor
    only sends after receiving a gradient the stage has not produced yet.
    """
    depths = pipe.warmup_depths()
    last = len(depths) - 1
    for s, w in enumerate(depths):
        field = f"{where}.stages[{s}].warmup_microbatches"
        if s == last and w != 0:
            raise ConfigError(file, field, f"{w} on the last stage",
                              "0: the last stage runs each backward right after its forward")
        if s < last and w < 1:
            raise ConfigError(file, field, f"{w} on a stage before the last",
                              f"1..{pipe.num_microbatches}")
        if s > 0 and w > depths[s - 1]:
            raise ConfigError(file, field, f"{w} > {depths[s - 1]} of stage {s - 1}",
                              f"<= {depths[s - 1]}: warm-up depths must not increase along "
                              "the pipeline (a deeper stage after a shallower one deadlocks 1F1B)")


def validate_plan(plan: Plan, file: str | Path = "<plan>") -> None:
    """Check every invariant the runtime relies on; raise ConfigError on the first violation."""
    if plan.objective not in OBJECTIVES:
        raise ConfigError(file, "objective", f"got {plan.objective!r}", ", ".join(OBJECTIVES))
    if plan.min_tokens_per_s is not None and (plan.objective not in FLOOR_OBJECTIVES
                                              or not plan.min_tokens_per_s > 0):
        raise ConfigError(file, "min_tokens_per_s", f"got {plan.min_tokens_per_s!r} with "
                          f"objective {plan.objective}",
                          f"a number > 0, with objective {' or '.join(FLOOR_OBJECTIVES)}")
    world = len(plan.ranks)
    if world == 0:
        raise ConfigError(file, "ranks", "empty", "one entry per global rank")
    for i, info in enumerate(plan.ranks):
        if info.rank != i:
            raise ConfigError(file, f"ranks[{i}].rank", f"got {info.rank}",
                              f"{i} (entries are listed in rank order 0..{world - 1})")
    seen_gpu: dict[tuple[str, int], int] = {}
    for info in plan.ranks:
        key = (info.node, info.local_rank)
        if key in seen_gpu:
            raise ConfigError(file, f"ranks[{info.rank}]",
                              f"node {info.node} GPU {info.local_rank} is already rank "
                              f"{seen_gpu[key]}", "each physical GPU once")
        seen_gpu[key] = info.rank
    if not plan.pipelines:
        raise ConfigError(file, "pipelines", "empty", "at least one pipeline")
    model = plan.model
    model.check_seq_length(plan.seq_length, file, "seq_length")
    owner: dict[int, str] = {}
    for p, pipe in enumerate(plan.pipelines):
        where = f"pipelines[{p}]"
        if not pipe.stages:
            raise ConfigError(file, f"{where}.stages", "empty", "at least one stage")
        if pipe.virtual_stages < 1:
            raise ConfigError(file, f"{where}.virtual_stages", f"got {pipe.virtual_stages}",
                              "an integer >= 1")
        expected_start = 0
        for s, stage in enumerate(pipe.stages):
            swhere = f"{where}.stages[{s}]"
            for r in stage.ranks:
                if not 0 <= r < world:
                    raise ConfigError(file, f"{swhere}.ranks", f"rank {r} out of range",
                                      f"0..{world - 1}")
                if r in owner:
                    raise ConfigError(file, f"{swhere}.ranks", f"rank {r} is already used by "
                                      f"{owner[r]}", "each rank in exactly one stage")
                owner[r] = swhere
            nodes = {plan.ranks[r].node for r in stage.ranks}
            if len(nodes) > 1:
                raise ConfigError(file, f"{swhere}.ranks", f"TP group spans nodes "
                                  f"{sorted(nodes)}", "ranks of one node")
            gpus = {plan.ranks[r].gpu for r in stage.ranks}
            if len(gpus) > 1:
                raise ConfigError(file, f"{swhere}.ranks", f"TP group mixes GPU types "
                                  f"{sorted(gpus)}", "ranks of one GPU type")
            model.check_tp_degree(stage.tp, file, f"{swhere}.ranks")
            if len(stage.chunks) != pipe.virtual_stages:
                raise ConfigError(file, f"{swhere}.layers", f"{len(stage.chunks)} model chunks "
                                  f"in a pipeline of virtual_stages {pipe.virtual_stages}",
                                  f"{pipe.virtual_stages}, one layer range per chunk")
            if (stage.warmup_microbatches is not None
                    and stage.warmup_microbatches > pipe.num_microbatches):
                raise ConfigError(file, f"{swhere}.warmup_microbatches",
                                  f"{stage.warmup_microbatches} > the pipeline's "
                                  f"{pipe.num_microbatches} micro-batches",
                                  f"0..{pipe.num_microbatches}")
        n = len(pipe.stages)
        for k, (start, end) in enumerate(pipe.virtual_stage_layers()):
            chunk = f"[{k // n}]" if pipe.interleaved else ""
            if start != expected_start or end <= start:
                raise ConfigError(file, f"{where}.stages[{k % n}].layers{chunk}",
                                  f"got [{start}, {end}) after layer {expected_start}",
                                  f"[{expected_start}, e) with e > {expected_start}: "
                                  + ("virtual stages (chunk c of stage s is c * stages + s) "
                                     if pipe.interleaved else "stages ")
                                  + "cover the model's layers in order")
            expected_start = end
        if expected_start != model.num_layers:
            raise ConfigError(file, f"{where}.stages", f"layers end at {expected_start}",
                              f"the last stage ends at num_layers = {model.num_layers}")
        if pipe.interleaved:
            _validate_interleaving(pipe, where, file)
        _validate_warmup(pipe, where, file)
    if plan.overlap_grad_reduce:
        check_overlap_grad_reduce(plan, file)
    unused = [r for r in range(world) if r not in owner]
    if unused:
        raise ConfigError(file, "pipelines", f"ranks {unused} have no stage",
                          "every rank in exactly one stage")
    total = plan.micro_batch_size * plan.num_microbatches_total
    if total != plan.global_batch_size:
        raise ConfigError(file, "global_batch_size",
                          f"{plan.global_batch_size} != micro_batch_size {plan.micro_batch_size} "
                          f"x {plan.num_microbatches_total} micro-batches", f"{total}")


def check_overlap_grad_reduce(plan: Plan, file: str | Path = "<plan>") -> None:
    """A plan trained with its gradient sync overlapped (its ``overlap_grad_reduce``, or a job's
    ``--overlap-grad-reduce``) has no interleaved pipeline: megatron's interleaved schedule
    re-enables the sync before each chunk's last backward, while the runtime has one no-sync
    switch for all of a stage's chunks (runtime/grad_sync.py), which would count the gradients
    of chunks still in their backward as final."""
    for p, pipe in enumerate(plan.pipelines):
        if pipe.interleaved:
            raise ConfigError(file, "overlap_grad_reduce",
                              f"overlapped gradient sync (the plan's field or "
                              f"--overlap-grad-reduce) with pipelines[{p}].virtual_stages "
                              f"{pipe.virtual_stages}",
                              "no overlap on a plan with interleaved pipelines: megatron's "
                              "interleaved schedule re-enables the sync before each chunk's last "
                              "backward, the runtime has one no-sync switch per stage")


def check_bf16_support(plan: Plan, catalog: dict[str, GPUType], file: str | Path = "<plan>"
                       ) -> None:
    """A plan that trains in bf16 puts no stage on a GPU type without bf16 (the catalog's
    ``bf16: false``: V100, T4); GPU types the catalog does not know are not judged.

    bf16 is the one 16-bit precision the runtime trains in (one P2P dtype per job): fp16 needs
    a dynamic loss scaler, which it does not have. Every planning path plans bf16 without such
    GPUs (spec/cluster.py ``trainable_fleet``, the same ``trains_in`` test); ``autohet
    train`` refuses a plan that would train bf16 on them (a hand-written one, or one priced
    from an fp32 profile), with one line naming the first such stage."""
    def unsupported(gpu: str) -> bool:
        return gpu in catalog and not trains_in(catalog[gpu], "bf16")

    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            gpu = plan.ranks[stage.ranks[0]].gpu
            if unsupported(gpu):
                names = sorted({i.gpu for i in plan.ranks if unsupported(i.gpu)})
                raise ConfigError(
                    file, f"pipelines[{p}].stages[{s}]",
                    f"plan stage {s} of pipeline {p} on {gpu}: bf16 not supported (the GPU "
                    f"catalog says bf16: false), and this runtime trains 16-bit only in bf16 "
                    f"(fp16 needs a dynamic loss scaler it does not have)",
                    f"a plan without {', '.join(names)} GPUs: take their nodes out of the "
                    f"cluster file and plan again")
