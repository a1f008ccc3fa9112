"""HeteroP2PCommunicator: exact activations and gradients between stages of different TP degree.

The multi-process tests run a chain of stages (global ranks numbered stage by stage) on gloo and
drive every method megatron's non-interleaved 1F1B calls, in the order 1F1B calls them, on
known tensors: each rank must end up with exactly its slice (SP) or the full tensor (no SP) of
what the neighbouring stage sent, for every micro-batch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage

from helpers.dist_utils import run_on_ranks
from megatron_autohet.layout.topology import RankRole, StageRole
from megatron_autohet.runtime.p2p import (BoundaryGroups, HeteroP2PCommunicator, SchedulePosition,
                                          StageLayout, StageLinks, transfer_plan)

SEQ, MBS, HIDDEN = 8, 2, 4


def chain_roles(tps: list[int], num_microbatches: int = 2) -> list[RankRole]:
    """RankRoles of one pipeline whose stage s has TP tps[s], ranks numbered stage by stage."""
    groups, next_rank = [], 0
    for tp in tps:
        groups.append(tuple(range(next_rank, next_rank + tp)))
        next_rank += tp
    n = len(tps)
    roles = []
    for s, ranks in enumerate(groups):
        stage = StageRole(pipeline=0, stage=s, num_stages=n, ranks=ranks, layers=(s, s + 1),
                          num_microbatches=num_microbatches,
                          warmup_microbatches=min(n - s - 1, num_microbatches),
                          prev_ranks=groups[s - 1] if s > 0 else None,
                          next_ranks=groups[s + 1] if s < n - 1 else None)
        roles += [RankRole(rank=r, tp_rank=k, stage=stage, microbatch_offset=0)
                  for k, r in enumerate(ranks)]
    return roles


def chain_links(tps: list[int], rank: int):
    """This rank's boundary groups of the chain (collective: every rank of the chain calls it)."""
    from megatron_autohet.runtime.parallel_state import create_p2p_links
    return create_p2p_links(list(dict.fromkeys(r.stage for r in chain_roles(tps))), rank)


def group_ops(group) -> int | None:
    """How many operations this rank has run on ``group`` (gloo counts sends and receives)."""
    return None if group is None else group._get_sequence_number_for_group()


def activation(stage: int, microbatch: int, grad: bool) -> torch.Tensor:
    """A distinct full [s, b, h] tensor per (stage boundary, micro-batch, direction)."""
    base = 1000 * stage + 100 * microbatch + (50 if grad else 0)
    return torch.arange(SEQ * MBS * HIDDEN, dtype=torch.float32).view(SEQ, MBS, HIDDEN) + base


def local_part(full: torch.Tensor, layout: StageLayout, tp_rank: int) -> torch.Tensor:
    start, end = layout.held_range(tp_rank, full.shape[0])
    return full[start:end].clone()


def _run_chain(rank, world_size, tps, sequence_parallel):
    """Two micro-batches through the chain in 1F1B order; returns the checks this rank made and
    how many operations it ran on each group (boundary groups, default group)."""
    import torch.distributed as dist
    role = chain_roles(tps)[rank]
    links = chain_links(tps, rank)
    groups = {f"{side}.{direction}": getattr(boundary, direction, None)
              for side, boundary in (("prev", links.prev), ("next", links.next))
              for direction in ("activations", "gradients")}
    groups["default"] = dist.group.WORLD
    before = {name: group_ops(group) for name, group in groups.items()}
    stage = role.stage
    layout = StageLayout(stage.ranks, sequence_parallel)
    config = ModelParallelConfig(tensor_model_parallel_size=stage.tp_size,
                                 sequence_parallel=layout.seq_chunks > 1,
                                 pipeline_model_parallel_size=stage.num_stages,
                                 pipeline_dtype=torch.float32)
    comm = HeteroP2PCommunicator(role, config, links=links, sequence_parallel=sequence_parallel)
    shapes = [(SEQ // layout.seq_chunks, MBS, HIDDEN)]          # what get_tensor_shapes returns
    first, last = stage.is_first, stage.is_last
    # megatron's own stage tests read our SchedulePosition as the pipeline group
    assert is_pp_first_stage(comm.pp_group) == first and is_pp_last_stage(comm.pp_group) == last
    s = stage.stage
    mine = lambda t: local_part(t, layout, role.tp_rank)           # noqa: E731
    checked = []

    def check(received, expected):
        assert received is not None and received.requires_grad
        assert received.shape == expected.shape, (received.shape, expected.shape)
        assert torch.equal(received.detach(), expected), (rank, received, expected)
        checked.append(tuple(expected.shape))

    # warm-up (depth 1 on non-last stages of this chain), then 1F1B for micro-batch 1.
    inp = comm.recv_forward(shapes, first)
    if first:
        assert inp == [None]
    else:
        check(inp[0], mine(activation(s - 1, 0, grad=False)))
    if not last:
        comm.send_forward([mine(activation(s, 0, grad=False))], last)
        inp = comm.recv_forward(shapes, first)
        if not first:
            check(inp[0], mine(activation(s - 1, 1, grad=False)))
        out_grad = comm.send_forward_recv_backward([mine(activation(s, 1, grad=False))], shapes,
                                                   last)
        check(out_grad[0], mine(activation(s, 0, grad=True)))
        # backward of micro-batch 0, last 1F1B iteration: plain send_backward
        comm.send_backward([mine(activation(s - 1, 0, grad=True))] if not first else [None],
                           first)
        out_grad = comm.recv_backward(shapes, last)                 # cool-down
        check(out_grad[0], mine(activation(s, 1, grad=True)))
        comm.send_backward([mine(activation(s - 1, 1, grad=True))] if not first else [None],
                           first)
    else:
        assert comm.send_forward_recv_backward([torch.zeros(1)], shapes, last) == [None]
        inp = comm.send_backward_recv_forward([mine(activation(s - 1, 0, grad=True))], shapes,
                                              first)
        check(inp[0], mine(activation(s - 1, 1, grad=False)))
        # single-tensor form (megatron unwraps when given a single shape / tensor)
        comm.send_backward(mine(activation(s - 1, 1, grad=True)), first)
    comm.finish_sends()
    ops = {name: None if group is None else group_ops(group) - before[name]
           for name, group in groups.items()}
    return checked, ops


CHAINS = [[2, 1], [1, 2], [2, 4], [4, 2], [1, 4], [2, 1, 2]]


@pytest.mark.integration
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize("tps", CHAINS, ids=["->".join(map(str, c)) for c in CHAINS])
def test_chain_exact(tps, sequence_parallel):
    checked = [c for c, _ in run_on_ranks(sum(tps), _run_chain, tps, sequence_parallel,
                                          timeout=60)]
    roles = chain_roles(tps)
    for role, shapes in zip(roles, checked):
        # first stages check 2 gradients, last stages 2 activations, middle stages both
        expected = 2 * (not role.stage.is_first) + 2 * (not role.stage.is_last)
        assert len(shapes) == expected, (role, shapes)


def _covers_exactly_once(src: StageLayout, dst: StageLayout, seq: int):
    transfers = transfer_plan(src, dst, seq)
    for j, rank in enumerate(dst.ranks):
        got = sorted((t.start, t.end) for t in transfers if t.dst == rank)
        lo, hi = dst.held_range(j, seq)
        assert got[0][0] == lo and got[-1][1] == hi
        assert all(a[1] == b[0] for a, b in zip(got, got[1:])), got   # contiguous, no overlap
    for t in transfers:
        k = src.ranks.index(t.src)
        lo, hi = src.held_range(k, seq)
        assert lo <= t.start < t.end <= hi                             # the sender holds it
    return transfers


@pytest.mark.unit
def test_replicated_layouts_send_one_copy_per_receiver():
    a, b = StageLayout((0, 1), False), StageLayout((2, 3, 4, 5), False)
    forward = _covers_exactly_once(a, b, 8)
    assert [(t.src, t.dst) for t in forward] == [(0, 2), (1, 3), (0, 4), (1, 5)]
    backward = _covers_exactly_once(b, a, 8)
    assert [(t.src, t.dst) for t in backward] == [(2, 0), (3, 1)]


@pytest.mark.unit
def test_sequence_parallel_reslicing():
    a, b = StageLayout((0, 1), True), StageLayout((2, 3, 4, 5), True)
    assert [(t.src, t.dst, t.start, t.end) for t in _covers_exactly_once(a, b, 8)] == [
        (0, 2, 0, 2), (0, 3, 2, 4), (1, 4, 4, 6), (1, 5, 6, 8)]
    assert [(t.src, t.dst, t.start, t.end) for t in _covers_exactly_once(b, a, 8)] == [
        (2, 0, 0, 2), (3, 0, 2, 4), (4, 1, 4, 6), (5, 1, 6, 8)]
    # SP TP2 -> TP1 (which cannot be sequence parallel): the TP1 rank gathers both halves
    one = StageLayout((2,), True)
    assert one.seq_chunks == 1
    assert [(t.src, t.start, t.end) for t in _covers_exactly_once(a, one, 8)] == [(0, 0, 4),
                                                                                (1, 4, 8)]
    # uneven degrees (TP2 -> TP3 with SP) still re-slice exactly
    _covers_exactly_once(a, StageLayout((2, 3, 4), True), 12)
    with pytest.raises(ValueError, match="not divisible"):
        transfer_plan(a, StageLayout((2, 3, 4), True), 8)


@pytest.mark.unit
def test_schedule_position_gives_megatron_the_plan_depth():
    for stage, warmup, first, last in [(0, 1, True, False), (0, 3, True, False),
                                       (1, 2, False, False), (2, 0, False, True)]:
        pos = SchedulePosition(stage, warmup)
        assert pos.size() - pos.rank() - 1 == warmup      # megatron's warm-up formula
        assert (pos.rank() == 0) == first and (pos.rank() == pos.size() - 1) == last
    # the standard depth reproduces the real pipeline rank and size
    assert SchedulePosition(1, 4 - 1 - 1).size() == 4


@pytest.mark.unit
def test_communicator_tells_megatron_the_plan_depth_the_way_this_megatron_core_reads_it():
    """0.16 reads the stage position from ``pp_group``, 0.17+ from the communicator's own
    properties (module doc, "The warm-up depth"): on either, megatron's formula gives the plan's
    depth, and where megatron's P2PCommunicator defines those properties (0.17+), its own
    definitions applied to ours answer the same as ours."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    dummy = BoundaryGroups(activations=object(), gradients=object())
    for warmups in ([2, 1, 0], [3, 3, 0], [1, 1, 0]):
        for role in chain_roles([2, 1, 1], num_microbatches=4):
            stage = dataclasses.replace(role.stage, warmup_microbatches=warmups[role.stage.stage])
            config = ModelParallelConfig(tensor_model_parallel_size=stage.tp_size,
                                         pipeline_dtype=torch.float32)
            links = StageLinks(prev=dummy if stage.prev_ranks else None,
                               next=dummy if stage.next_ranks else None)
            comm = HeteroP2PCommunicator(dataclasses.replace(role, stage=stage), config,
                                         links=links, sequence_parallel=False)
            pp = comm.pp_group                                   # what 0.16 reads
            assert pp.size() - pp.rank() - 1 == stage.warmup_microbatches
            assert (pp.rank() == 0, pp.rank() == pp.size() - 1) == (stage.is_first,
                                                                    stage.is_last)
            assert comm.total_stages - comm.current_stage - 1 == stage.warmup_microbatches
            assert (comm.is_pp_first_stage, comm.is_pp_last_stage) == (stage.is_first,
                                                                       stage.is_last)
            # megatron's is_pp_*_stage helpers answer for the default group without
            # torch.distributed, so only the two plain properties are compared here.
            for name in ("total_stages", "current_stage"):
                upstream = getattr(P2PCommunicator, name, None)      # a property on 0.17+
                if upstream is not None:
                    assert upstream.fget(comm) == getattr(comm, name), name


@pytest.mark.unit
def test_communicator_rejects_inconsistent_config():
    role = chain_roles([2, 1])[0]
    config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=False,
                                 pipeline_dtype=torch.float32)
    with pytest.raises(ValueError, match="sequence_parallel"):
        HeteroP2PCommunicator(role, config, links=None, sequence_parallel=True)


def _run_ahead(rank, world_size):
    """Stage 0 sends two activations and waits for both sends before stage 1 asks for the second."""
    role = chain_roles([1, 1])[rank]
    config = ModelParallelConfig(pipeline_dtype=torch.float32, pipeline_model_parallel_size=2)
    comm = HeteroP2PCommunicator(role, config, links=chain_links([1, 1], rank),
                                 sequence_parallel=False, forward_only=True)
    shapes = [(SEQ, MBS, HIDDEN)]
    if rank == 0:
        assert comm.recv_forward(shapes, True) == [None]
        comm.send_forward([activation(0, 0, grad=False)], False)
        comm.send_forward([activation(0, 1, grad=False)], False)
        comm.finish_sends()      # hangs (test timeout) unless stage 1 pre-posted micro-batch 1
        torch.distributed.barrier()
        return []
    first = comm.recv_forward(shapes, False)[0].detach().clone()
    torch.distributed.barrier()  # stage 1 has not asked for micro-batch 1 yet
    second = comm.recv_forward(shapes, False)[0].detach()
    comm.finish_sends()
    assert torch.equal(first, activation(0, 0, grad=False))
    assert torch.equal(second, activation(0, 1, grad=False))
    return [2]


@pytest.mark.integration
def test_next_receive_is_posted_ahead_so_a_send_completes_before_it_is_needed():
    assert run_on_ranks(2, _run_ahead, timeout=30) == [[], [2]]


@pytest.mark.integration
def test_each_direction_of_a_boundary_has_its_own_group():
    """A 3-stage chain of single ranks: the middle stage talks to both neighbours. Every
    activation travels on its boundary's activations group and every gradient on its gradients
    group (gloo counts each send and receive on the group that ran it), none on the default group;
    the two groups of a boundary are distinct, so each direction has its own TCP connection."""
    out = run_on_ranks(3, _run_chain, [1, 1, 1], False, timeout=60)
    ops = [o for _, o in out]
    two = 2                                       # micro-batches, one message each per direction
    assert ops == [
        {"prev.activations": None, "prev.gradients": None,
         "next.activations": two, "next.gradients": two, "default": 0},
        {"prev.activations": two, "prev.gradients": two,
         "next.activations": two, "next.gradients": two, "default": 0},
        {"prev.activations": two, "prev.gradients": two,
         "next.activations": None, "next.gradients": None, "default": 0}]


def _links_of_plan_stages(rank, world_size):
    links = chain_links([2, 1, 2], rank)
    boundaries = [b for b in (links.prev, links.next) if b is not None]
    return [(sorted(torch.distributed.get_process_group_ranks(b.activations)),
             sorted(torch.distributed.get_process_group_ranks(b.gradients)),
             b.activations is not b.gradients,
             group_ops(b.activations), group_ops(b.gradients)) for b in boundaries]


@pytest.mark.integration
def test_boundary_groups_span_both_stages_of_the_boundary():
    """Two groups per boundary over both stages' ranks, each opened by exactly one collective of
    all its ranks (NCCL allows P2P batches of only some ranks of a group after that)."""
    out = run_on_ranks(5, _links_of_plan_stages, timeout=60)
    first, second = ([0, 1, 2], [0, 1, 2], True, 1, 1), ([2, 3, 4], [2, 3, 4], True, 1, 1)
    assert out == [[first], [first], [first, second], [second], [second]]
