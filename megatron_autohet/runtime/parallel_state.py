"""Process groups for one rank of a heterogeneous plan, for megatron-core and for our runtime.

Public API
----------
``build_parallel_state(plan, rank=None, *, model=None, plan_file="<plan>") -> HeteroParallelState``
    ``torch.distributed`` must be initialised. Checks the job against the plan first (world size,
    this rank's role, the job's model vs the plan's, every plan invariant incl. TP dividing heads)
    and raises :class:`ConfigError` before any group is created; then creates every group, in the
    same order on every rank, and installs the ``megatron.core.parallel_state`` globals.
``check_job_matches_plan(plan, rank, world_size, model, plan_file="<plan>")``
    The same input checks without torch.distributed (a launcher can run them before starting
    processes).
``create_p2p_links(stages, rank) -> StageLinks``
    Collective over the world: for every pipeline boundary of ``stages`` (all stages of the
    job, same order on every rank) one group per direction; returns this rank's (see Design).
``HeteroParallelState``: ``plan``, ``role`` (:class:`RankRole`), ``rank``, ``world_size``,
    ``tp_group``, ``pp_group`` (:class:`StagePosition`), ``pipeline_group``, ``cp_group``,
    ``dp_group``, ``sync_groups`` (list of :class:`SyncGroup`, one per
    ``topology.sync_group_specs(plan)`` entry, same order), ``p2p_links``
    (:class:`~megatron_autohet.runtime.p2p.StageLinks`), ``pg_collection`` (megatron's
    ``ProcessGroupCollection`` for ``GPTModel(pg_collection=)`` and the schedules); properties
    ``tp_size``, ``tp_rank``, ``stage`` (StageRole), ``is_first_stage``, ``is_last_stage``,
    ``word_embedding_sync`` / ``position_embedding_sync`` / ``post_process_sync`` (the SyncGroup
    of that kind or None).
``SyncGroup``: ``spec`` (SyncGroupSpec), ``ranks`` (this rank's group: tuple, or None when this
    rank holds none of those parameters), ``group`` (the torch group or None).
``StagePosition``: ``rank()`` = stage index, ``size()`` = number of stages, ``ranks``.

Design
------
* Megatron has one TP x PP x DP grid; a plan has pipelines of different depth whose stages have
  different TP degrees. Everything a rank needs is derived from ``layout/topology.py`` (pure,
  identical on every rank), so ``new_group`` calls happen in the same order everywhere. Groups are
  de-duplicated by rank set (a single-rank TP group *is* that rank's singleton group; an
  embedding sync group may equal a layer sync group): one torch group per distinct rank set.
* ``pg_collection.pp`` is a :class:`StagePosition`, not a communicator. Within a heterogeneous
  pipeline there is no regular "one rank per stage" group (a TP2 stage feeds a TP1 stage), and
  ``new_group`` orders members by global rank, not by stage. megatron-core reads only
  ``rank()``/``size()`` of it when building the model and running the schedules
  (``get_pg_rank``/``get_pg_size``/``is_pp_first_stage`` in transformer_block.py, gpt_model.py,
  language_module.py); activations travel through ``runtime/p2p.py`` with global ranks, and the
  schedules read the stage position from the P2P communicator (runtime/p2p.py).
* P2P groups: every pipeline boundary (the TP groups of stages s and s+1, which hold
  every rank pair the communicator's ``transfer_plan`` uses there) gets two groups over both
  stages' ranks, one for the activations going forward and one for the gradients coming back.
  A gloo group has one TCP connection per rank pair, and one connection carried the two
  directions one after the other (scripts/bench_hapt.py's shaped link: 8 x 256 KiB each way
  took 1.82 s on one group, 0.87 s one way, 1.01 s with a group per direction), so forward and
  backward traffic of a boundary could not overlap on the default group. Two groups per
  boundary is the fewest that give each direction its own connections (a group per rank pair
  and direction would be more groups for the same connections); each ``new_group`` is
  collective over the world, so they number 2 x (stages - pipelines), all created after the
  groups above and never shared with a collective (not de-duplicated by rank set). Each is
  opened with one all-reduce over its ranks, which NCCL requires before P2P batches of only some
  of them (runtime/p2p.py); every rank does it for its own groups in creation order, so the
  earliest group not yet opened always has all its ranks at it (no deadlock).
* ``pg_collection.embd`` and ``pos_embd`` are None on purpose: megatron's
  ``LanguageModule.setup_embeddings_and_output_layer`` would all-reduce the output layer into the
  embedding (zero + sum), which assumes exactly two equally sharded copies; here tied copies live
  on the first and last stage of *every* pipeline, possibly at different TP degrees. The stage
  model initialises both copies identically instead (``runtime/init.py``), and the tied-weight
  gradient sync uses ``word_embedding_sync`` (``runtime/grad_sync.py``). The schedules only touch
  ``embd`` when ``config.finalize_model_grads_func`` is set, which our runtime does not use.
* ``pg_collection.cp`` is this rank's singleton group (no context parallelism); ``tp_cp`` = tp.
* Data parallelism is layer-wise (``sync_groups``). For megatron code that asks for "the" DP
  group, ``dp_group`` / ``dp_cp`` is the sync group of this rank's first layer run (in a
  symmetric plan exactly Megatron's DP group), and the DP rank/size globals report the pipeline
  index / number of pipelines (what a data-parallel replica index means in a plan).
* Megatron globals: what megatron reads from ``megatron.core.parallel_state``'s private module
  globals, with no parameter to pass a group, is written by ``_install_megatron_globals`` (TP,
  PP rank/size as overrides since the PP "group" is a StagePosition, this pipeline as the model
  parallel group, DP as above, embedding groups, expert parallel = 1, the sequence-parallel
  buffer); the section above ``_megatron_globals`` lists each with who reads it. It is the only
  module that writes megatron-core's private state, and the only version difference there
  (0.17+'s DP aliases) is handled beside the list.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_autohet.errors import ConfigError
from megatron_autohet.layout.topology import (RankRole, StageRole, SyncGroupSpec, rank_role,
                                              stage_roles, sync_group_specs)
from megatron_autohet.plan import Plan, validate_plan
from megatron_autohet.runtime.p2p import BoundaryGroups, StageLinks, p2p_device
from megatron_autohet.spec.model import ModelSpec


@dataclass(frozen=True)
class StagePosition:
    """This rank's place in its pipeline, answering the ProcessGroup calls megatron makes on PP."""

    stage: int
    num_stages: int
    ranks: tuple[int, ...]          # the pipeline's global ranks, one per stage (see module doc)

    def rank(self) -> int:
        return self.stage

    def size(self) -> int:
        return self.num_stages


@dataclass
class SyncGroup:
    spec: SyncGroupSpec
    ranks: tuple[int, ...] | None
    group: object | None            # torch.distributed.ProcessGroup


@dataclass
class HeteroParallelState:
    plan: Plan
    role: RankRole
    rank: int
    world_size: int
    tp_group: object
    pp_group: StagePosition
    pipeline_group: object
    cp_group: object
    dp_group: object
    sync_groups: list[SyncGroup]
    p2p_links: StageLinks
    pg_collection: object           # megatron.core.process_groups_config.ProcessGroupCollection

    @property
    def stage(self) -> StageRole:
        return self.role.stage

    @property
    def tp_size(self) -> int:
        return self.role.stage.tp_size

    @property
    def tp_rank(self) -> int:
        return self.role.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.role.stage.is_first

    @property
    def is_last_stage(self) -> bool:
        return self.role.stage.is_last

    def _sync_of_kind(self, kind: str) -> SyncGroup | None:
        return next((g for g in self.sync_groups if g.spec.kind == kind), None)

    @property
    def word_embedding_sync(self) -> SyncGroup | None:
        return self._sync_of_kind("word_embeddings")

    @property
    def position_embedding_sync(self) -> SyncGroup | None:
        return self._sync_of_kind("position_embeddings")

    @property
    def post_process_sync(self) -> SyncGroup | None:
        return self._sync_of_kind("post_process")


def check_job_matches_plan(plan: Plan, rank: int, world_size: int, model: ModelSpec | None,
                           plan_file: str | Path = "<plan>") -> None:
    """Everything that can be wrong between a plan and this job, as a ConfigError."""
    validate_plan(plan, plan_file)
    if model is not None and model != plan.model:
        job, planned = model.to_dict(), plan.model.to_dict()
        diffs = [k for k in job if job[k] != planned[k]]
        raise ConfigError(plan_file, f"model.{diffs[0]}",
                          f"the plan was made for {diffs[0]}={planned[diffs[0]]!r} but the job's "
                          f"model {model.name!r} has {job[diffs[0]]!r}",
                          "a plan made for this model (re-plan)")
    if plan.world_size != world_size:
        raise ConfigError(plan_file, "ranks", f"the plan has {plan.world_size} ranks but the job "
                          f"has world size {world_size}",
                          f"a plan for exactly {world_size} ranks (re-plan for this job)")
    # validate_plan has put every rank of 0..world_size-1 in exactly one stage.
    if not 0 <= rank < world_size:
        raise ConfigError(plan_file, "ranks", f"rank {rank} is outside the job's world "
                          f"(size {world_size})", f"0..{world_size - 1}")


class _GroupFactory:
    """One torch group per distinct rank set, created in call order (same on every rank)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._groups: dict[frozenset, object] = {}

    def get(self, ranks) -> object | None:
        key = frozenset(ranks)
        if key not in self._groups:
            self._groups[key] = dist.new_group(sorted(key))
        return self._groups[key] if self.rank in key else None


def create_p2p_links(stages, rank: int) -> StageLinks:
    """Two groups per pipeline boundary of ``stages`` (module doc, "P2P groups"); this rank's.

    Collective over the world: every rank passes all stages of the job in the same order
    (``topology.stage_roles``)."""
    prev = nxt = None
    mine = []
    for stage in stages:
        if stage.next_ranks is None:
            continue
        ranks = sorted(stage.ranks + stage.next_ranks)
        groups = BoundaryGroups(activations=dist.new_group(ranks),
                                gradients=dist.new_group(ranks))
        if rank in stage.ranks:
            nxt = groups
        elif rank in stage.next_ranks:
            prev = groups
        if rank in ranks:
            mine += [groups.activations, groups.gradients]
    for group in mine:      # the first call on each group involves all its ranks (module doc)
        dist.all_reduce(torch.zeros(1, device=p2p_device()), group=group)
    return StageLinks(prev=prev, next=nxt)


def _pipeline_chain(role: RankRole, plan: Plan) -> tuple[int, ...]:
    """For each stage of this rank's pipeline, the rank holding this rank's TP fraction."""
    frac_num, frac_den = role.tp_rank, role.stage.tp_size
    return tuple(s.ranks[frac_num * s.tp // frac_den]
                 for s in plan.pipelines[role.stage.pipeline].stages)


def build_parallel_state(plan: Plan, rank: int | None = None, *, model: ModelSpec | None = None,
                         plan_file: str | Path = "<plan>") -> HeteroParallelState:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before build_parallel_state")
    world_size = dist.get_world_size()
    if rank is None:
        rank = dist.get_rank()
    check_job_matches_plan(plan, rank, world_size, model, plan_file)
    if rank != dist.get_rank():
        raise RuntimeError(f"build_parallel_state(rank={rank}) called on global rank "
                           f"{dist.get_rank()}")
    role = rank_role(plan, rank)
    factory = _GroupFactory(rank)

    # Creation order (identical on every rank): singletons, TP groups, pipelines, sync groups,
    # P2P groups.
    # Later factory.get calls for an existing rank set return the cached group.
    for r in range(world_size):
        factory.get([r])
    for stage in stage_roles(plan):
        factory.get(stage.ranks)
    for pipeline in plan.pipelines:
        factory.get(pipeline.ranks)
    sync_groups = []
    for spec in sync_group_specs(plan):
        mine = None
        for ranks in spec.groups():
            group = factory.get(ranks)
            if group is not None:
                mine = SyncGroup(spec, tuple(ranks), group)
        sync_groups.append(mine or SyncGroup(spec, None, None))
    p2p_links = create_p2p_links(stage_roles(plan), rank)

    tp_group = factory.get(role.stage.ranks)
    pipeline_group = factory.get(plan.pipelines[role.stage.pipeline].ranks)
    cp_group = factory.get([rank])
    first_layer = role.stage.layers[0]
    dp_sync = next(g for g in sync_groups if g.spec.kind == "layers"
                   and g.spec.layers[0] <= first_layer < g.spec.layers[1])
    pp_position = StagePosition(role.stage.stage, role.stage.num_stages,
                                _pipeline_chain(role, plan))

    # megatron-core: on first use, not with this module
    from megatron.core.process_groups_config import ProcessGroupCollection
    pg_collection = ProcessGroupCollection(
        tp=tp_group, pp=pp_position, mp=pipeline_group, embd=None, pos_embd=None, cp=cp_group,
        tp_cp=tp_group, dp=dp_sync.group, dp_cp=dp_sync.group)
    state = HeteroParallelState(
        plan=plan, role=role, rank=rank, world_size=world_size, tp_group=tp_group,
        pp_group=pp_position, pipeline_group=pipeline_group, cp_group=cp_group,
        dp_group=dp_sync.group, sync_groups=sync_groups, p2p_links=p2p_links,
        pg_collection=pg_collection)
    _install_megatron_globals(state, sorted(dp_sync.ranks))
    return state


# ---- megatron.core.parallel_state's private globals ---------------------------------------------
# megatron-core takes our groups as ``pg_collection`` wherever it accepts one (GPTModel and its
# layers, the schedules, sharded_state_dict's ``dp_cp_group``, the RNG seeding's ranks). What
# still reads the module-level globals of ``megatron.core.parallel_state`` has no parameter to
# hand it a group, and megatron-core has no public setter (``initialize_model_parallel`` builds
# one regular TP x PP x DP grid, which a plan is not), so this is the one place that writes them.
# Each entry says who reads it. Values are this rank's: its stage's TP group, its pipeline, and
# for "data parallel" the sync group of its first layer (module doc). Supported: megatron-core
# 0.16.1 to 0.19.x (setup.py); a name missing here means another version, and is refused.


def _megatron_globals(state: HeteroParallelState, dp_ranks: list[int]) -> dict[str, object]:
    role, plan = state.role, state.plan
    word, pos = state.word_embedding_sync, state.position_embedding_sync
    return {
        # Tensor parallelism. RowParallelLinear's forward hands its matmul ``tp_group=None``,
        # which looks this group up; 0.16's GPTModel loss (vocab_parallel_cross_entropy) takes
        # no group and reads group, rank and size here; get_tensor_model_parallel_src_rank
        # reads the ranks (Megatron-LM's training loop).
        "_TENSOR_MODEL_PARALLEL_GROUP": state.tp_group,
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": list(role.stage.ranks),
        "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": role.stage.tp_size,
        "_MPU_TENSOR_MODEL_PARALLEL_RANK": role.tp_rank,
        # Pipeline. The layer numbering (0.19's get_transformer_layer_offset does not pass its
        # pp_rank on to the layer layout, which reads get_pipeline_model_parallel_rank) and
        # is_pipeline_first/last_stage (Megatron-LM's training loop) read rank and size as
        # overrides, since the "group" is a StagePosition; first/last/next/prev-rank read the
        # pipeline's ranks, one per stage holding this rank's TP fraction.
        "_PIPELINE_MODEL_PARALLEL_GROUP": state.pp_group,
        "_PIPELINE_GLOBAL_RANKS": list(state.pp_group.ranks),
        "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": role.stage.num_stages,
        "_MPU_PIPELINE_MODEL_PARALLEL_RANK": role.stage.stage,
        # Model chunks per stage of an interleaved pipeline (None: not interleaved, as
        # initialize_model_parallel leaves it): the layer layout's get_layer_offset and
        # get_num_layers_to_build read it and take chunk 0's layers for every chunk without it.
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": (role.stage.num_chunks
                                                        if role.stage.num_chunks > 1 else None),
        # Model parallel = this pipeline: get_model_parallel_group() (megatron's optimizer
        # wrappers and Megatron-LM's reductions of the gradient norm over a model replica).
        "_MODEL_PARALLEL_GROUP": state.pipeline_group,
        "_MODEL_PARALLEL_GLOBAL_RANKS": list(plan.pipelines[role.stage.pipeline].ranks),
        # No context parallelism: the CP getters (size 1) that megatron-core code not handed a
        # pg_collection and Megatron-LM's batch slicing call.
        "_CONTEXT_PARALLEL_GROUP": state.cp_group,
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": [state.rank],
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": state.tp_group,
        # Data parallel. parallel_state.is_initialized() is "the DP group is set": without it
        # megatron treats the process as uninitialised. The DP rank feeds the replica ids of
        # megatron's sharded state dicts (overwritten by checkpoint/state.py from the owner map)
        # and Megatron-LM's data sampler and logging: pipeline index / number of pipelines.
        "_DATA_PARALLEL_GROUP": state.dp_group,
        "_DATA_PARALLEL_GROUP_WITH_CP": state.dp_group,
        "_DATA_PARALLEL_GLOBAL_RANKS": list(dp_ranks),
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": list(dp_ranks),
        "_MPU_DATA_PARALLEL_WORLD_SIZE": len(plan.pipelines),
        "_MPU_DATA_PARALLEL_RANK": role.stage.pipeline,
        # Tied embeddings: is_rank_in_embedding_group() and the embedding getters (Megatron-LM's
        # training loop); the tied-weight sync itself is runtime/grad_sync.py's.
        "_EMBEDDING_GROUP": word.group if word else None,
        "_EMBEDDING_GLOBAL_RANKS": list(word.ranks) if word and word.ranks else None,
        "_POSITION_EMBEDDING_GROUP": pos.group if pos else None,
        "_POSITION_EMBEDDING_GLOBAL_RANKS": list(pos.ranks) if pos and pos.ranks else None,
        # No experts: the expert getters answer 1 / 0 (expert TP = TP) without a group.
        "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE": 1,
        "_MPU_EXPERT_MODEL_PARALLEL_RANK": 0,
        "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE": role.stage.tp_size,
        "_MPU_EXPERT_TENSOR_PARALLEL_RANK": role.tp_rank,
    }


# The one version difference in the globals: megatron-core 0.17 added a "GTP weight
# rematerialisation" variant of the DP groups, and get_data_parallel_group() returns it by default
# (to megatron code that looks the DP group up: sharded_state_dict without a dp_cp_group, which
# checkpoint/state.py passes, Megatron-LM's training loop). Without that feature it is the plain
# DP group, as initialize_model_parallel sets it.
_DP_ALIASES_SINCE_0_17 = {
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "_DATA_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "_DATA_PARALLEL_GROUP_WITH_CP",
}


def _install_megatron_globals(state: HeteroParallelState, dp_ranks: list[int]) -> None:
    # megatron-core: on first use, not with this module
    from megatron.core import package_info
    from megatron.core import parallel_state as mps

    mps.destroy_model_parallel()
    values = _megatron_globals(state, dp_ranks)
    if hasattr(mps, next(iter(_DP_ALIASES_SINCE_0_17))):
        values.update({alias: values[name] for alias, name in _DP_ALIASES_SINCE_0_17.items()})
    for name, value in values.items():
        if not hasattr(mps, name):
            raise RuntimeError(f"megatron.core.parallel_state has no {name}: megatron-core "
                               f"{package_info.__version__} is not supported (0.16.1 to 0.19.x)")
        setattr(mps, name, value)
    # Sequence parallelism's all-gather buffer (tensor_parallel/layers.py asks for it by getter).
    mps._set_global_memory_buffer()
