"""Which rank holds the MAIN copy of each parameter chunk: a pure function of the plan.

A parameter lives on several ranks: on one TP group per pipeline (data parallelism), on every TP
rank of that group when it is TP-replicated, and on the first and the last stages when it is the
tied word embedding. A checkpoint writes exactly one replica of each chunk (a TP shard, or a whole
TP-replicated parameter) and the grad norm counts each chunk once, so both need the same answer
to "which copy is the main one", from nothing but the plan.

Rule:

* Holders of a parameter (by its global name, layout/params.py): per pipeline in pipeline order,
  the TP group of the stage that holds it - layer L: the stage whose layers contain L; the word
  embedding: first stages, then last stages too when embeddings are tied; position embedding:
  first stages; final layernorm and untied output layer: last stages - with repeated TP groups
  dropped (a 1-stage pipeline's stage is both first and last). These are exactly the holders of
  the parameter's gradient sync group (layout/topology.py), which is where they are read from.
* The main holder is the first holder: pipeline 0 first; for a tied word embedding, the first
  stage of pipeline 0 before any last stage.
* Within the main holder, a TP-sharded parameter has one main chunk per TP rank (each rank owns
  its shard); a TP-replicated one is owned by TP rank 0 only.
"""

from __future__ import annotations

from megatron_autohet.layout.params import ParamLayout
from megatron_autohet.layout.topology import rank_role, spec_index_of, sync_group_specs
from megatron_autohet.plan import Plan


def holders(plan: Plan, global_name: str) -> tuple[tuple[int, ...], ...]:
    """The TP groups (ranks in TP-rank order) holding the parameter, in holder order.
    ValueError for a name that no stage of the plan holds."""
    specs = sync_group_specs(plan)
    return specs[spec_index_of(global_name, specs)].holders


def main_holder(plan: Plan, global_name: str) -> tuple[int, ...]:
    return holders(plan, global_name)[0]


def holds_main_replica(param_holders: tuple[tuple[int, ...], ...], holder: tuple[int, ...],
                       layout: ParamLayout) -> bool:
    """Whether TP rank ``layout.tp_rank`` of the TP group ``holder`` holds a main chunk of the
    parameter held by ``param_holders`` (for callers that already have the holders)."""
    return holder == param_holders[0] and (layout.partition_dim is not None
                                           or layout.tp_rank == 0)


def is_main_replica(plan: Plan, rank: int, layout: ParamLayout) -> bool:
    """Whether ``rank``'s copy of the parameter ``layout`` (one of ``rank``'s parameters) is the
    main one of its chunk."""
    return holds_main_replica(holders(plan, layout.global_name),
                              rank_role(plan, rank).stage.ranks, layout)
