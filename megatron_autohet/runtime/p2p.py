"""Point-to-point transfers between pipeline stages of different TP degree.

Public API
----------
``StageLayout(ranks, sequence_parallel)``
    How one stage holds the activation ``[s, b, h]`` passed between stages: ``ranks`` is its TP
    group in TP-rank order; with sequence parallelism (and TP > 1) TP rank k holds the sequence
    slice ``[k*s/t, (k+1)*s/t)``, otherwise every TP rank holds the whole tensor.
``Transfer(src, dst, start, end)`` / ``transfer_plan(src, dst, seq_length) -> tuple[Transfer]``
    Pure: which global rank sends which global sequence range to which. Both sides compute it
    identically, so no shapes or metadata are ever exchanged.
``SchedulePosition(stage, warmup_microbatches)``
    The ``pp_group`` megatron's 1F1B schedule reads (``rank()``, ``size()``); see below.
``BoundaryGroups(activations, gradients)`` / ``StageLinks(prev, next)``
    The process groups of a pipeline boundary, one per direction, and a rank's two boundaries
    (``runtime/parallel_state.create_p2p_links`` creates them; see "One group per direction").
``HeteroP2PCommunicator(role, config, *, links, sequence_parallel, forward_only=False)``
    Drop-in for megatron-core's ``P2PCommunicator`` in
    ``forward_backward_pipelining_without_interleaving``: ``recv_forward``, ``send_forward``,
    ``recv_backward``, ``send_backward``, ``send_forward_recv_backward``,
    ``send_backward_recv_forward`` with megatron's signatures and list/single-tensor conventions,
    plus ``config``, ``pp_group`` and :meth:`~HeteroP2PCommunicator.finish_sends`; and in
    ``forward_backward_pipelining_with_interleaving`` (see "Interleaved pipelines"):
    ``send_forward_recv_forward``, ``send_backward_recv_backward``,
    ``send_forward_backward_recv_forward_backward`` and ``virtual_pipeline_model_parallel_size``.
    One communicator serves one schedule run (``forward_only`` as passed to megatron's schedule).

Which rank sends what (no duplicate copies)
-------------------------------------------
Without sequence parallelism every TP rank of a stage holds the full stage output: the last
op of each layer is a row-parallel linear whose output is all-reduced, and the residual adds are
replicated. The same holds backwards: without sequence parallelism megatron's
``ColumnParallelLinear`` all-reduces its input gradient across the TP group
(``allreduce_dgrad`` in tensor_parallel/layers.py), and
the residual and layer-norm paths are replicated computation on identical data, so the gradient
of a stage's input is identical on all its TP ranks. A receiver therefore needs one copy of
each sequence range, not one per sender: receiver TP rank j takes each range it needs from the
``j mod n``-th of the ``n`` sender ranks holding it, which spreads the sends over the sender's TP
ranks and sends ``t_next`` (forward) / ``t_prev`` (backward) messages instead of
``t_prev * t_next``. With sequence parallelism each rank holds a distinct slice and the plan
re-slices exactly: a receiver gets every intersection of its slice with the senders' slices.
Stages with TP 1 cannot use sequence parallelism (megatron refuses it), so ``sequence_parallel``
is a per-run switch that applies to every stage with TP > 1; layouts may differ between
neighbours (SP TP2 -> non-SP TP1 and back). Each ordered rank pair carries at most one message
per micro-batch and direction, so messages match in FIFO order without tags (NCCL has none).

Deferred sends and pre-posted receives: what makes the HAPT warm-up overlap a slow link
-----------------------------------------------------------------------------------------
A call posts its sends and waits only for its receive; a send completes in the background and is
only waited for when its handle is pruned or by :meth:`finish_sends` at the end of the schedule.
Stock megatron waits for sends too, and a gloo send does not move its bytes before the receiver
posts the matching receive (measured: an ``isend`` of 16 floats waits until the peer's
``irecv``), while megatron's 1F1B asks for each receive just before it needs the data. So the
communicator keeps the receive of the *next* micro-batch posted in each direction: 1F1B receives
activations 0..m-1 from the previous stage and gradients 0..m-1 from the next one, in that order
(none in a forward-only run), with static shapes; the first call posts micro-batch 0 of both
directions, and as soon as micro-batch k has been taken the irecv of k+1 goes out into a fresh
buffer. A send posted early (a stage running ahead with a deeper warm-up) then travels while its
receiver computes, on gloo's own I/O threads. Exactly m receives are posted per direction and
schedule and all of them are taken, so none is left for a later schedule's message to fall into
(:meth:`finish_sends` checks it). Messages still match correctly: the direction is implied by the
peer (activations only come from the previous stage's ranks, gradients only from the next
one's), each ordered rank pair carries one message per micro-batch and shape, and both sides
post them in micro-batch order.

Deadlock freedom. Pre-posting adds no wait: a stage still blocks only when megatron asks for a
receive, at the same program points as before, and sends never block (:meth:`finish_sends`
returns because every peer posts all its receives within its own schedule); so megatron's
non-interleaved 1F1B is deadlock-free for any per-stage warm-up depths
``w_0 >= w_1 >= ... >= w_{n-1}``:

    A stuck stage waits on a receive. A receive of an activation waits on the previous stage,
    a receive of a gradient on the next one, so a cycle of waits contains two neighbours s, s+1
    where s waits for the gradient of micro-batch j and s+1 waits for an activation k that s has
    not sent yet. When s posts the receive of gradient j it has already posted the sends of
    activations 0..min(w_s + j, M-1) (it does so in the same call, or earlier in cool-down).
    Stage s+1 posts the send of gradient j right after the backward of j, by which time it has
    received activations 0..min(w_{s+1} + j, M-1); so k <= min(w_{s+1} + j, M-1)
    <= min(w_s + j, M-1): activation k was already posted, contradiction.

``w_{s+1} > w_s`` deadlocks (s+1 needs activation w_s + 1 before it sends gradient 0, which s
only sends after receiving it), so plan validation enforces a non-increasing warm-up, with 0 on
the last stage and >= 1 before it (megatron_autohet/plan.py). Stock megatron's blocking sends
would, by the same kind of argument, also forbid a stage running more than two micro-batches
ahead of its successor (``w_{s+1} >= w_s - 2``; derived, not exercised, since this communicator
never blocks on a send). The standard depths ``w_s = n - s - 1`` satisfy both.

The warm-up depth: how it reaches megatron's schedule. Megatron computes it inside
``forward_backward_pipelining_without_interleaving`` as "stages - this stage - 1", and there is
no argument to pass a depth. megatron-core 0.16 reads ``p2p_communicator.pp_group.size() -
p2p_communicator.pp_group.rank() - 1`` (first stage: ``rank() == 0``; last: ``rank() == size() -
1``); 0.17 and later read the communicator's own ``total_stages - current_stage - 1`` and
``is_pp_first_stage`` / ``is_pp_last_stage`` properties, which megatron's P2PCommunicator
defines on its ``pp_group`` in exactly that way. :class:`HeteroP2PCommunicator` has both: its
``pp_group`` is a :class:`SchedulePosition` answering ``rank() = stage`` and ``size() = stage +
warmup + 1``, and the four properties answer from it. With the default depth that is exactly the
pipeline's real rank and size; with a plan's depth megatron runs that depth, unpatched, on both
versions (tests/runtime/test_schedule.py checks the calls megatron makes in warm-up on either).

Interleaved pipelines (plan.py ``virtual_stages``): megatron-core's interleaved 1F1B runs the
stage's v model chunks, and the model's order runs round the pipeline v times, so the pipeline
is a ring: the last stage's chunk c sends its activations to the first stage's chunk c + 1 and
gets their gradients back. The ring's closing boundary is one more boundary of the pipeline
(``StageRole.prev_ranks`` of the first stage and ``next_ranks`` of the last are each other's,
layout/topology.py), with its own two groups, TP degrees on its two sides as they come (TP1 ->
TP2 re-slices as any boundary). Which chunk a message is for is implied by the order: megatron
sends and receives the virtual micro-batches of each direction in one order on both sides (its
own P2PCommunicator relies on that), so each direction's queue counts them through all chunks:
``m * v`` per direction, ``m * (v - 1)`` where the ring closes (the first stage's chunk 0 gets no
activations, the last stage's last chunk no gradients). Megatron passes None for what is not
sent there and ``recv_prev`` / ``recv_next`` False for what is not received. Deadlock freedom is
megatron's own: its interleaved schedule is deadlock-free with its blocking batches, and this
communicator only removes waits (sends never block; a pre-posted receive blocks only when megatron
asks for it, at the same program point). What megatron's interleaved schedule does not take: a
warm-up depth of the plan's (it derives ``2 (n - s - 1) + (v - 1) n`` from the stage's position,
which also decides the chunk of each virtual micro-batch; so ``pp_group`` answers the true
position there, and plan validation refuses ``warmup_microbatches`` on interleaved pipelines) and
``overlap_p2p_comm`` (refused; the pre-posted receives already overlap the transfers).

One group per direction. Peers are global ranks; the group is the boundary's group of the
direction (``links``): activations to the next stage and from the previous one on that
boundary's ``activations`` group, gradients on its ``gradients`` group. A gloo group has one
TCP connection per rank pair, and on the default group the two directions of a boundary shared
it and moved one after the other: on a rate-limited link (scripts/bench_hapt.py) 8 x 256 KiB
each way took 1.82 s where one way took 0.87 s (1.01 s with a group per direction): a
boundary's activations and gradients were never on the wire at the same time. Each group
carries one direction, so the FIFO matching above holds per group. Sends and receives of one
call are on different groups and are posted separately (a batch must use one group).

gloo and NCCL run this same code; what NCCL adds is said where it matters:

* Groups: ``torch.distributed.new_group`` is collective over the world on both backends, and on
  NCCL the first collective call on a group must involve all its ranks before a
  ``batch_isend_irecv`` of only some of them is allowed (torch's ``batch_isend_irecv``
  documentation): a boundary batch involves one or a few rank pairs, so
  ``parallel_state.create_p2p_links`` runs one all-reduce over each new group's ranks right
  away (on gloo it only costs a message; it is done there too so both run one sequence).
* Pre-posted receives: NCCL runs the operations of one communicator in posting order on one
  stream, so on a group carrying both directions a receive posted ahead would hold up the next
  send behind it (stage s's gradient k behind its pre-posted activation k+1, while stage s-1's
  activation k+1 sits behind its pre-posted gradient k: a deadlock). With one group per
  direction a rank only sends or only receives on each group, so a receive posted ahead can only
  wait in front of later receives of the same direction, never in front of a send. This is
  megatron-core's own arrangement for overlapping the two directions
  (``p2p_communication._p2p_ops`` puts one of them on a second group).
* Coalescing and streams: on NCCL ``batch_isend_irecv`` coalesces a batch (one micro-batch's
  receives, or one call's sends) into one handle, on gloo it gives one handle per op; either
  way a batch's tensors are kept until all its handles complete. ``Work.wait`` on NCCL makes
  the current stream wait, not the host, so taking a receive does not block the host there
  either. Megatron-core's ``config.batch_p2p_sync`` (a ``torch.cuda.synchronize()`` after each
  batch, its workaround for a race in old torch releases) is not applied: it would block the
  host on every call and undo the overlap above.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from megatron_autohet.layout.topology import RankRole


def p2p_device() -> torch.device:
    """Where P2P buffers live: the current CUDA device where there is one (NCCL needs it), else
    the CPU (gloo)."""
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


@dataclass(frozen=True)
class StageLayout:
    ranks: tuple[int, ...]
    sequence_parallel: bool

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    @property
    def seq_chunks(self) -> int:
        """Number of distinct sequence slices the stage's ranks hold (1 = replicated)."""
        return self.tp_size if self.sequence_parallel and self.tp_size > 1 else 1

    def chunk_of(self, tp_rank: int) -> int:
        return tp_rank if self.seq_chunks > 1 else 0

    def held_range(self, tp_rank: int, seq_length: int) -> tuple[int, int]:
        """Global sequence positions [start, end) that TP rank ``tp_rank`` holds."""
        size = seq_length // self.seq_chunks
        chunk = self.chunk_of(tp_rank)
        return chunk * size, (chunk + 1) * size


@dataclass(frozen=True)
class Transfer:
    src: int      # global rank
    dst: int      # global rank
    start: int    # global sequence positions [start, end)
    end: int


@lru_cache(maxsize=None)
def transfer_plan(src: StageLayout, dst: StageLayout, seq_length: int) -> tuple[Transfer, ...]:
    """Every message that moves an activation (or its gradient) from ``src``'s layout to ``dst``'s.

    Each destination rank receives each position it holds exactly once; among the source ranks
    holding a range, destination TP rank j uses the (j mod n)-th, spreading the load.
    """
    for layout in (src, dst):
        if seq_length % layout.seq_chunks:
            raise ValueError(f"sequence length {seq_length} is not divisible by the "
                             f"{layout.seq_chunks} sequence-parallel slices of stage "
                             f"{layout.ranks}")
    transfers = []
    for j, dst_rank in enumerate(dst.ranks):
        lo, hi = dst.held_range(j, seq_length)
        for chunk in range(src.seq_chunks):
            holders = [r for k, r in enumerate(src.ranks) if src.chunk_of(k) == chunk]
            start, end = src.held_range(src.ranks.index(holders[0]), seq_length)
            start, end = max(lo, start), min(hi, end)
            if start < end:
                transfers.append(Transfer(holders[j % len(holders)], dst_rank, start, end))
    return tuple(transfers)


@dataclass(frozen=True)
class SchedulePosition:
    """What megatron's non-interleaved 1F1B reads from ``p2p_communicator.pp_group``.

    ``size() - rank() - 1`` is the warm-up depth; ``rank() == 0`` marks the first stage and
    ``rank() == size() - 1`` the last one (see the module docstring).
    """

    stage: int
    warmup_microbatches: int

    def rank(self) -> int:
        return self.stage

    def size(self) -> int:
        return self.stage + self.warmup_microbatches + 1


def _refuse_overlap_p2p(overlap_p2p_comm: bool) -> None:
    if overlap_p2p_comm:
        raise ValueError("config.overlap_p2p_comm is not supported: the communicator already "
                         "posts every send and the next receive ahead (runtime/p2p.py)")


def _is_single_shape(x) -> bool:
    """Megatron's convention (p2p_communication.is_single_shape): one shape vs. a list of them."""
    if isinstance(x, torch.Size):
        return True
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(d, int) for d in x)


@dataclass(frozen=True)
class BoundaryGroups:
    """The process groups of one pipeline boundary (stage s to s+1), one per direction, each over
    both stages' ranks: activations travel on ``activations``, gradients on ``gradients``."""

    activations: object     # torch.distributed.ProcessGroup
    gradients: object


@dataclass(frozen=True)
class StageLinks:
    """This rank's boundary groups: to the previous stage and to the next one (None at the ends)."""

    prev: BoundaryGroups | None
    next: BoundaryGroups | None


@dataclass(frozen=True)
class _Link:
    """One direction to one neighbour: its layout and the boundary group of that direction."""

    peer: StageLayout
    group: object | None


class HeteroP2PCommunicator:
    """Sends and receives stage activations/gradients between TP groups of any size."""

    def __init__(self, role: RankRole, config, *, links: StageLinks,
                 sequence_parallel: bool, forward_only: bool = False, clock=None):
        stage = role.stage
        # Times the waits below (runtime/iteration_clock.py); none: untimed.
        self._waiting = clock.p2p_wait if clock is not None else nullcontext
        self.config = config
        self.rank = role.rank
        self.tp_rank = role.tp_rank
        self.layout = StageLayout(stage.ranks, sequence_parallel)
        if bool(config.sequence_parallel) != (self.layout.seq_chunks > 1):
            raise ValueError(f"config.sequence_parallel={config.sequence_parallel} but a stage "
                             f"of TP {self.layout.tp_size} with sequence_parallel="
                             f"{sequence_parallel} must use {self.layout.seq_chunks > 1}")
        if getattr(config, "variable_seq_lengths", False):
            raise ValueError("variable_seq_lengths is not supported: shapes come from the layout")
        warmup = stage.warmup_microbatches
        if stage.is_last != (warmup == 0):
            raise ValueError(f"stage {stage.stage} of {stage.num_stages}: warm-up depth {warmup} "
                             "(the last stage needs 0, the others >= 1)")
        self.pp_group = SchedulePosition(stage.stage, warmup)
        # megatron's interleaved schedule reads it here (as P2PCommunicator copies it from the
        # config) for its warm-up depth: the chunks per stage, None when not interleaved.
        self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size
        self._device = p2p_device()
        to_prev = from_prev = to_next = from_next = None
        if stage.prev_ranks is not None:
            if links is None or links.prev is None:
                raise ValueError(f"stage {stage.stage} needs the groups of its boundary to the "
                                 "previous stage (HeteroParallelState.p2p_links)")
            prev_layout = StageLayout(stage.prev_ranks, sequence_parallel)
            from_prev = _Link(prev_layout, links.prev.activations)
            to_prev = _Link(prev_layout, links.prev.gradients)
        if stage.next_ranks is not None:
            if links is None or links.next is None:
                raise ValueError(f"stage {stage.stage} needs the groups of its boundary to the "
                                 "next stage (HeteroParallelState.p2p_links)")
            next_layout = StageLayout(stage.next_ranks, sequence_parallel)
            to_next = _Link(next_layout, links.next.activations)
            from_next = _Link(next_layout, links.next.gradients)
        self._to_prev, self._to_next = to_prev, to_next
        # Each posted batch of sends: its handles and the tensors they read (module doc).
        self._pending_sends: list[tuple[list, list[torch.Tensor]]] = []
        # Activations come from the previous stage, gradients from the next one, each in the
        # order megatron's schedule runs them; a forward-only run receives no gradients. Every
        # chunk of a stage takes each micro-batch once, except where the ring of an interleaved
        # pipeline closes: the first stage's chunk 0 and the last stage's last chunk (module doc).
        m, v = stage.num_microbatches, stage.num_chunks
        self._activations = (_ReceiveQueue(from_prev, m * (v - 1 if stage.is_first else v))
                             if from_prev else None)
        self._gradients = (_ReceiveQueue(from_next, m * (v - 1 if stage.is_last else v))
                           if from_next and not forward_only else None)

    # ---- where megatron's 1F1B reads this stage's position ------------------------------------
    # megatron-core 0.16 reads ``pp_group.rank()``/``size()``; 0.17 and later read these
    # properties of the communicator (P2PCommunicator defines them on its pp_group the same way).
    # Both answer from the one SchedulePosition, so the warm-up depth is the plan's on both.
    @property
    def current_stage(self) -> int:
        return self.pp_group.rank()

    @property
    def total_stages(self) -> int:
        return self.pp_group.size()

    @property
    def is_pp_first_stage(self) -> bool:
        return self.pp_group.rank() == 0

    @property
    def is_pp_last_stage(self) -> bool:
        return self.pp_group.rank() == self.pp_group.size() - 1

    # ---- the methods megatron's non-interleaved schedule calls --------------------------------
    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        return self._communicate(tensor_shapes, None if is_first_stage else self._activations)

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        return self._communicate(tensor_shapes, None if is_last_stage else self._gradients)

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        if not is_last_stage:
            self._communicate(None, None, sends=output_tensors, send_to=self._to_next)

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        if not is_first_stage:
            self._communicate(None, None, sends=input_tensor_grads, send_to=self._to_prev)

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        if is_last_stage:
            return self._communicate(tensor_shapes, None)
        return self._communicate(tensor_shapes, self._gradients, sends=output_tensors,
                                 send_to=self._to_next)

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        if is_first_stage:
            return self._communicate(tensor_shapes, None)
        return self._communicate(tensor_shapes, self._activations, sends=input_tensor_grads,
                                 send_to=self._to_prev)

    # ---- and those megatron's interleaved schedule calls besides -----------------------------
    # ``output_tensor`` / ``input_tensor_grad`` None: nothing to send (megatron passes None at the
    # ends of the model); ``recv_prev`` / ``recv_next``: whether a tensor is expected.
    def send_forward_recv_forward(self, output_tensor, recv_prev: bool, tensor_shape,
                                  overlap_p2p_comm: bool = False):
        _refuse_overlap_p2p(overlap_p2p_comm)
        return self._communicate(tensor_shape, self._activations if recv_prev else None,
                                 sends=output_tensor, send_to=self._to_next)

    def send_backward_recv_backward(self, input_tensor_grad, recv_next: bool, tensor_shape,
                                    overlap_p2p_comm: bool = False):
        _refuse_overlap_p2p(overlap_p2p_comm)
        return self._communicate(tensor_shape, self._gradients if recv_next else None,
                                 sends=input_tensor_grad, send_to=self._to_prev)

    def send_forward_backward_recv_forward_backward(self, output_tensor, input_tensor_grad,
                                                    recv_prev: bool, recv_next: bool,
                                                    tensor_shape):
        # Both sends are posted before either receive is waited for, as in megatron's one batch.
        self._communicate(None, None, sends=output_tensor, send_to=self._to_next)
        self._communicate(None, None, sends=input_tensor_grad, send_to=self._to_prev)
        input_tensor = self._communicate(tensor_shape,
                                         self._activations if recv_prev else None)
        output_tensor_grad = self._communicate(tensor_shape,
                                               self._gradients if recv_next else None)
        return input_tensor, output_tensor_grad

    def finish_sends(self) -> None:
        """End of the schedule: wait for every send still in flight (call before the sent tensors
        may change) and make sure no receive is left posted for a later schedule to fall into."""
        with self._waiting():
            for works, _ in self._pending_sends:
                for work in works:
                    work.wait()
        self._pending_sends.clear()
        for queue in (self._activations, self._gradients):
            if queue is not None and queue.ahead is not None:
                for work in queue.ahead[1]:   # the peer sends all its micro-batches: this ends
                    work.wait()
                queue.ahead = None
                raise RuntimeError(f"the schedule took {queue.taken} of {queue.total} "
                                   f"micro-batches from ranks {queue.link.peer.ranks}; a receive "
                                   f"was left posted")

    # ---- internals ---------------------------------------------------------------------------
    def _communicate(self, tensor_shapes, queue: _ReceiveQueue | None, *, sends=None,
                     send_to: _Link | None = None):
        """Post ``sends`` to ``send_to`` and, with a ``queue``, return its next micro-batch.

        Follows megatron's conventions: a single shape gives a single tensor (or None), a list of
        shapes a list; ``None`` stands in for every tensor when there is no ``queue``.
        """
        single = tensor_shapes is not None and _is_single_shape(tensor_shapes)
        shapes = ([] if tensor_shapes is None else
                  [tuple(tensor_shapes)] if single else [tuple(x) for x in tensor_shapes])
        send_ops = [op for tensor in (sends if isinstance(sends, list) else [sends])
                    for op in self._send_ops(tensor, send_to)] if sends is not None else []
        # Sends and receives are on different groups (one per direction), so never batched
        # together; the sends complete in the background.
        if shapes:
            self._keep_posted(shapes)
        if send_ops:
            self._pending_sends.append((dist.batch_isend_irecv(send_ops),
                                        [op.tensor for op in send_ops]))
        self._pending_sends = [(works, tensors) for works, tensors in self._pending_sends
                               if not all(work.is_completed() for work in works)]
        if queue is None:
            return None if single else [None] * len(shapes)
        received = self._take(queue, shapes)
        self._keep_posted(shapes)
        return received[0] if single else received

    def _keep_posted(self, shapes: list[tuple[int, ...]]) -> None:
        """Post the receive of each queue's next micro-batch unless it is posted or all are."""
        for queue in (self._activations, self._gradients):
            if queue is not None and queue.ahead is None and queue.posted < queue.total:
                buffers, ops = self._recv_ops(queue, shapes)
                queue.ahead = (buffers, dist.batch_isend_irecv(ops))

    def _take(self, queue: _ReceiveQueue, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Wait for the posted receive of the queue's next micro-batch and hand its buffers over."""
        if queue.ahead is None:           # only when every micro-batch was posted and taken
            raise RuntimeError(f"receive of micro-batch {queue.taken} from ranks "
                               f"{queue.link.peer.ranks}, but the pipeline has {queue.total}")
        buffers, works = queue.ahead
        queue.ahead = None
        if [tuple(b.shape) for b in buffers] != shapes:
            raise RuntimeError(f"receive of shapes {shapes} from ranks {queue.link.peer.ranks}, "
                               f"but {[tuple(b.shape) for b in buffers]} was posted "
                               "(shapes must be static)")
        with self._waiting():
            for work in works:
                work.wait()
        queue.taken += 1
        for buffer in buffers:
            buffer.requires_grad_()
        return buffers

    def _recv_ops(self, queue: _ReceiveQueue, shapes: list[tuple[int, ...]]
                  ) -> tuple[list[torch.Tensor], list[dist.P2POp]]:
        """Fresh buffers for the queue's next micro-batch and the irecvs that fill them."""
        dtype = self.config.pipeline_dtype
        if dtype is None:
            raise RuntimeError("config.pipeline_dtype must be set to receive activations")
        if queue.posted >= queue.total:
            raise RuntimeError(f"receive of micro-batch {queue.posted} from ranks "
                               f"{queue.link.peer.ranks}, but the pipeline has {queue.total}")
        queue.posted += 1
        buffers, ops = [], []
        for shape in shapes:
            seq_length = shape[0] * self.layout.seq_chunks
            my_start, _ = self.layout.held_range(self.tp_rank, seq_length)
            buffer = torch.empty(shape, dtype=dtype, device=self._device)
            buffers.append(buffer)
            for t in transfer_plan(queue.link.peer, self.layout, seq_length):
                if t.dst == self.rank:
                    ops.append(dist.P2POp(dist.irecv, buffer[t.start - my_start:t.end - my_start],
                                          t.src, group=queue.link.group))
        return buffers, ops

    def _send_ops(self, send: torch.Tensor, link: _Link) -> list[dist.P2POp]:
        """This rank's part of sending one stage-layout tensor over ``link``."""
        seq_length = send.shape[0] * self.layout.seq_chunks
        my_start, _ = self.layout.held_range(self.tp_rank, seq_length)
        # A detached view keeps the storage alive even if megatron later swaps the output's
        # .data (deallocate_pipeline_outputs) while the deferred send is still in flight.
        data = send.detach()
        return [dist.P2POp(dist.isend, data[t.start - my_start:t.end - my_start], t.dst,
                           group=link.group)
                for t in transfer_plan(self.layout, link.peer, seq_length) if t.src == self.rank]


@dataclass
class _ReceiveQueue:
    """The receives of one direction, in micro-batch order: activations from the previous stage
    or gradients from the next one. ``ahead`` is the posted receive of the next micro-batch
    (its buffers, one per shape, and the handles of its irecvs) or None."""

    link: _Link
    total: int
    posted: int = 0
    taken: int = 0
    ahead: tuple[list[torch.Tensor], list] | None = None
