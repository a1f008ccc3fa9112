"""Overlapped gradient sync (``--overlap-grad-reduce``) trains as the sync after the backward.

Each plan trains ITERS iterations twice on one gloo process per planned GPU, from the same
weights on the same global batches: with ``overlap_grad_reduce`` (each bucket launched by
megatron-core's readiness bookkeeping during the last micro-batch's backward,
runtime/grad_sync.py) and without.
Required: every iteration's loss and grad norm, and every rank's final parameters, bit-identical
between the two (the same collectives on the same buffers), the losses and grad norms within
1e-5 of the single-process reference (testing/reference.py), and proof that the overlap
happened: from the second iteration on (the first records megatron's golden counts and launches
at its end), every bucket a rank launches is launched while megatron's schedule still runs, in
the rank's fixed launch order, and some before the backward has produced every gradient. A
bucket launched before its last micro-batch's gradients are in makes the losses differ from the
reference and from the non-overlapped run.
"""

from __future__ import annotations

import pytest

from megatron_autohet.plan import load_plan
from helpers.dist_utils import run_on_ranks
from helpers.training import OPTIMIZER, PLANS, SEED, global_batches, rel, scheduled_steps

pytestmark = pytest.mark.integration

ITERS = 3
REL = 1e-5

OVERLAP_PLANS = [   # (plan, sequence parallelism on TP>1 stages, distributed optimizer)
    ("tiny-homogeneous.yaml", False, False),    # symmetric: TP1 x PP2 x DP2
    ("tiny-two-pipelines.yaml", False, False),  # asymmetric: [TP2 | TP1] next to [TP1], m 3 and 1
    ("tiny-two-pipelines.yaml", True, False),   # the same with SP: TP sums inside the backward
    ("tiny-tp-change.yaml", False, True),       # asymmetric, reduce-scattered shards
]


def _train(rank, world, plan, batches, sequence_parallel, distributed_optimizer, overlap):
    """(metrics, final parameters, per iteration: (buckets launched inside the schedule,
    launched in all, launched before the backward had made every gradient final), whether
    every launch followed the launch order)."""
    import megatron_autohet.runtime.trainer as trainer_module
    from megatron_autohet.runtime.trainer import HeteroTrainer

    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=SEED, optimizer=OPTIMIZER,
                            sequence_parallel=sequence_parallel,
                            distributed_optimizer=distributed_optimizer,
                            overlap_grad_reduce=overlap)
    grad_sync = trainer.grad_sync
    in_schedule, launches, in_order = [False], [], [True]
    schedule, launch_next = trainer_module.run_schedule, grad_sync._launch_next

    def timed_schedule(*args, **kwargs):
        launches.append([0, 0, 0])
        in_schedule[0] = True
        try:
            return schedule(*args, **kwargs)
        finally:
            in_schedule[0] = False

    def recorded_launch():
        expected = grad_sync.launch_order[len(grad_sync._pending)]
        # gradients of this backward still to come: the launch overlaps the rest of it
        to_come = sum(len(r.params) - len(r.per_param_grad_ready_counts)
                      for r in grad_sync._readiness)
        launch_next()
        in_order[0] &= grad_sync._pending[-1][0] is expected
        launches[-1][0] += in_schedule[0]
        launches[-1][1] += 1
        launches[-1][2] += to_come > 0

    trainer_module.run_schedule = timed_schedule
    grad_sync._launch_next = recorded_launch
    try:
        metrics, _ = scheduled_steps(trainer, batches)
    finally:
        trainer_module.run_schedule = schedule
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return ([(m.loss, m.grad_norm) for m in metrics], params, [tuple(x) for x in launches],
            in_order[0])


def _reference(rank, world, plan, batches):
    from megatron_autohet.runtime.stage_model import plan_padded_vocab_size
    from megatron_autohet.testing.reference import run_reference

    steps = run_reference(plan.model, batches, micro_batch_size=plan.micro_batch_size, seed=SEED,
                          optimizer=OPTIMIZER, padded_vocab=plan_padded_vocab_size(plan))
    return [(s.loss, s.grad_norm) for s in steps]


@pytest.mark.parametrize("plan_file,sequence_parallel,distributed_optimizer", OVERLAP_PLANS)
def test_overlapped_sync_is_bit_identical_and_overlaps(plan_file, sequence_parallel,
                                                       distributed_optimizer):
    plan = load_plan(PLANS / plan_file)
    batches = global_batches(plan, ITERS)
    runs = {overlap: run_on_ranks(plan.world_size, _train, plan, batches, sequence_parallel,
                                  distributed_optimizer, overlap, timeout=180)
            for overlap in (False, True)}
    reference = run_on_ranks(1, _reference, plan, batches)[0]
    overlapped, plain = runs[True], runs[False]
    ours = overlapped[0][0]
    for rank, ((metrics, params, launches, in_order), (plain_metrics, plain_params, *_)) in \
            enumerate(zip(overlapped, plain)):
        assert metrics == plain_metrics, (rank, metrics, plain_metrics)
        for name, value in params.items():
            assert value.equal(plain_params[name]), (rank, name)
        assert in_order, f"rank {rank} launched a bucket out of its launch order"
        assert launches[0][0] == 0, (rank, launches)       # first iteration: at its end
        assert all(inside == total for inside, total, _ in launches[1:]), (rank, launches)
    # some rank launched a bucket while its backward still computed gradients of others
    assert any(early for _, _, rank_launches, _ in overlapped
               for _, _, early in rank_launches[1:]), [r[2] for r in overlapped]
    assert all(inside == 0 for _, _, rank_launches, _ in plain
               for inside, *_ in rank_launches)            # without overlap: after the schedule
    for (loss, norm), (ref_loss, ref_norm) in zip(ours, reference):
        assert rel(loss, ref_loss) <= REL and rel(norm, ref_norm) <= REL, (ours, reference)
