"""What a plan means for each rank, computed without torch.

The runtime creates its torch process groups from :func:`stage_roles` and
:func:`sync_group_specs` (runtime/parallel_state.py), which every rank computes identically from
the plan, so groups are created in the same order everywhere (a requirement of
``torch.distributed.new_group``); the cost model prices the same sync groups.

Data-parallel gradient sync is layer-wise: pipelines cut the model at different layers, so there
is no single DP group. A :class:`SyncGroupSpec` covers a run of parameters whose holders are the
same TP groups in every pipeline (a layer's holder in a pipeline is the stage one of whose model
chunks holds it: an interleaved stage holds several runs of layers):

* symmetric (every holder has the same TP degree t): t groups, group k = the k-th TP rank of each
  holder; each rank all-reduces its own shard, exactly as Megatron's DP all-reduce does;
* asymmetric (holders differ in TP degree, opt-in): one group of all holder ranks; the sync
  re-shards (see runtime/grad_sync.py).

:func:`spec_index_of` maps a parameter's global name to its spec, so the grad sync and
layout/owners.py read a parameter's holders from the same place.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from megatron_autohet.plan import Plan

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.")
_NON_LAYER_KINDS = (("embedding.word_embeddings.", "word_embeddings"),
                    ("embedding.position_embeddings.", "position_embeddings"),
                    ("decoder.final_layernorm.", "post_process"),
                    ("output_layer.", "post_process"))   # untied only: tied maps to word emb.


@dataclass(frozen=True)
class StageRole:
    pipeline: int
    stage: int
    num_stages: int
    ranks: tuple[int, ...]                  # this stage's TP group, TP-rank order
    layers: tuple[int, int]                 # [start, end) global layer indices
    num_microbatches: int                   # of this pipeline, per iteration
    warmup_microbatches: int                # 1F1B warm-up depth (plan's, or num_stages-stage-1)
    # TP group of the previous / next stage. An interleaved pipeline is a ring (the last stage's
    # chunk c feeds the first stage's chunk c + 1): there the first stage's previous stage is
    # the last one and the last stage's next stage the first one.
    prev_ranks: tuple[int, ...] | None
    next_ranks: tuple[int, ...] | None
    # [start, end) of each model chunk, in chunk order (``layers`` is chunk 0's): one range
    # unless the pipeline is interleaved (plan.py, "Interleaved pipelines").
    chunks: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if not self.chunks:
            object.__setattr__(self, "chunks", (tuple(self.layers),))

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True)
class RankRole:
    rank: int
    tp_rank: int
    stage: StageRole
    microbatch_offset: int   # index of this pipeline's first micro-batch in the global batch


@dataclass(frozen=True)
class SyncGroupSpec:
    """Holders of some parameters: one TP group (ranks) per pipeline, in pipeline order."""

    kind: str            # "layers", "word_embeddings", "position_embeddings", "post_process"
    layers: tuple[int, int] | None           # for kind == "layers": [start, end)
    holders: tuple[tuple[int, ...], ...]     # de-duplicated: a 1-stage pipeline holds both ends

    @cached_property     # asked once per group and rank by the cost model: thousands of times
    def symmetric(self) -> bool:
        return len({len(h) for h in self.holders}) == 1

    def groups(self) -> list[tuple[int, ...]]:
        """The rank lists to create, in a fixed order."""
        if self.symmetric:
            return [tuple(h[k] for h in self.holders) for k in range(len(self.holders[0]))]
        return [tuple(sorted(r for h in self.holders for r in h))]


def stage_roles(plan: Plan) -> list[StageRole]:
    roles = []
    for p, pipe in enumerate(plan.pipelines):
        n = len(pipe.stages)
        ring = pipe.interleaved
        warmups = pipe.warmup_depths()
        for s, stage in enumerate(pipe.stages):
            roles.append(StageRole(
                pipeline=p, stage=s, num_stages=n, ranks=tuple(stage.ranks), layers=stage.layers,
                num_microbatches=pipe.num_microbatches, warmup_microbatches=warmups[s],
                prev_ranks=(tuple(pipe.stages[s - 1].ranks) if s > 0 or ring else None),
                next_ranks=(tuple(pipe.stages[(s + 1) % n].ranks) if s < n - 1 or ring
                            else None),
                chunks=stage.chunks))
    return roles


def rank_role(plan: Plan, rank: int) -> RankRole:
    for role in stage_roles(plan):
        if rank in role.ranks:
            offset = sum(p.num_microbatches for p in plan.pipelines[:role.pipeline])
            return RankRole(rank=rank, tp_rank=role.ranks.index(rank), stage=role,
                            microbatch_offset=offset)
    raise KeyError(f"rank {rank} has no role in this plan (world size {plan.world_size})")


def _dedup(holders: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    return tuple(dict.fromkeys(holders))          # first occurrence wins: pipeline order kept


def sync_group_specs(plan: Plan) -> list[SyncGroupSpec]:
    """Layer runs with identical holders, then the embedding and post-process groups, in a fixed
    order. "post_process" covers what only last stages hold besides the tied word embedding: the
    final layernorm and, when embeddings are untied, the output layer."""
    specs: list[SyncGroupSpec] = []
    # Each pipeline's holder per layer, then transposed: O(pipelines x layers), where searching
    # the stages per layer was O(pipelines x layers x stages) (plans of thousands of GPUs).
    owners = []
    for pipe in plan.pipelines:
        owner = [None] * plan.model.num_layers
        for s in pipe.stages:
            for start, end in s.chunks:
                owner[start:end] = [tuple(s.ranks)] * (end - start)
        owners.append(owner)
    holder_of_layer = list(zip(*owners))
    start = 0
    for layer in range(1, plan.model.num_layers + 1):
        if layer == plan.model.num_layers or holder_of_layer[layer] != holder_of_layer[start]:
            specs.append(SyncGroupSpec("layers", (start, layer), holder_of_layer[start]))
            start = layer
    firsts = [tuple(p.stages[0].ranks) for p in plan.pipelines]
    lasts = [tuple(p.stages[-1].ranks) for p in plan.pipelines]
    word = firsts + lasts if plan.model.tie_embeddings else firsts
    specs.append(SyncGroupSpec("word_embeddings", None, _dedup(word)))
    if plan.model.position_embedding_type == "learned_absolute":
        specs.append(SyncGroupSpec("position_embeddings", None, _dedup(firsts)))
    specs.append(SyncGroupSpec("post_process", None, _dedup(lasts)))
    return specs


def layer_of(global_name: str) -> int | None:
    """The global layer index of a transformer layer's parameter, None for the others."""
    match = _LAYER_NAME.match(global_name)
    return int(match.group(1)) if match else None


def gradient_ready_key(spec: SyncGroupSpec, layer: int | None = None) -> float:
    """When a backward makes the gradients of ``spec``'s parameters final, as a key that
    decreases along the backward: the post-process part first (inf), then the layers from the
    last to the first (``layer``, a parameter's own, default the spec's first), the embeddings
    last (-1; a tied word embedding accumulates its two uses). Every holder computes the same
    keys, so an order by them is one order for the whole job (runtime/grad_sync.py)."""
    if spec.kind == "post_process":
        return float("inf")
    if spec.kind == "layers":
        return spec.layers[0] if layer is None else layer
    return -1


def spec_index_of(global_name: str, specs: list[SyncGroupSpec]) -> int:
    """Index of the spec whose holders sync the parameter called ``global_name`` (megatron
    GPTModel naming with GLOBAL layer numbers)."""
    layer = layer_of(global_name)
    kind = "layers" if layer is not None else next(
        (kind for prefix, kind in _NON_LAYER_KINDS if global_name.startswith(prefix)), None)
    if kind is None:
        raise ValueError(f"parameter {global_name!r} belongs to no gradient sync group")
    for i, spec in enumerate(specs):
        if spec.kind == kind and (layer is None or spec.layers[0] <= layer < spec.layers[1]):
            return i
    raise ValueError(f"parameter {global_name!r}: the plan has no {kind} sync group for it")
