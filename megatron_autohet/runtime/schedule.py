"""One iteration's forward and backward passes of this rank's stage, on megatron-core's schedules.

Public API
----------
``run_schedule(forward_step_func, data_iterator, model, state, *, sequence_parallel=False,
forward_only=False, clock=None) -> list``
    Runs megatron-core's own ``forward_backward_pipelining_without_interleaving`` (a pipeline of
    several stages), ``forward_backward_pipelining_with_interleaving`` (a stage of several model
    chunks, runtime/stage_model.py ``ModelChunks``: an interleaved pipeline; each chunk gets an
    iterator over the same micro-batches, which it reads in megatron's order) or
    ``forward_backward_no_pipelining`` (a one-stage pipeline) over this
    pipeline's own ``num_microbatches`` of ``state.plan.micro_batch_size`` x
    ``state.plan.seq_length`` with ``state.pg_collection`` and, between stages, a
    :class:`~megatron_autohet.runtime.p2p.HeteroP2PCommunicator`. ``model`` is this rank's stage
    (megatron reads its ``config``, the stage's TransformerConfig, from it).
    ``sequence_parallel`` is the run-level switch (every stage with TP > 1 uses it; a TP-1 stage
    cannot, so its own config cannot tell), which the communicator needs to know its
    neighbours' layouts. ``clock`` (runtime/iteration_clock.py) times the communicator's waits.
    Returns megatron's
    ``forward_data_store``: on last stages the second value ``loss_func`` returned for each
    micro-batch, in order; ``[]`` elsewhere. Gradients are accumulated into ``param.grad``
    (or megatron DDP's buffers if the model is wrapped); syncing them is the caller's job.

What megatron's schedule does with our objects (megatron-core 0.16.1 to 0.19.x)
------------------------------------------------------------------------------
* Calls on the communicator: ``recv_forward`` and ``send_forward`` (warm-up),
  ``send_forward_recv_backward``, ``send_backward_recv_forward``, ``send_backward`` (steady 1F1B;
  ``send_forward``/``recv_forward`` there when ``forward_only``), ``recv_backward`` and
  ``send_backward`` (cool-down); it asserts ``.config`` and reads the stage position from
  ``.pp_group`` (0.16) or the ``total_stages`` / ``current_stage`` / ``is_pp_first_stage`` /
  ``is_pp_last_stage`` properties (0.17 and later), which the communicator answers from the same
  object.
* Reads from ``pg_collection`` (asserts ``tp``, ``cp`` exist; 0.16 also ``embd``, ``pos_embd``,
  ``pp``, ``dp_cp``): ``tp`` and ``cp`` for the tensor shapes, ``cp.size()`` for the loss, and the
  whole collection is handed to ``config.finalize_model_grads_func`` when one is set.
* Tensor shapes: ``(seq_length // cp // (tp if sequence_parallel), mbs, hidden)`` from the
  model's config, i.e. this stage's own layout; the communicator derives the neighbour's layout
  from the same numbers, so nothing is exchanged besides the tensors.
* Warm-up depth: ``min(stages - stage - 1, num_microbatches)`` with "stages" and "stage" read from
  the communicator (above); its :class:`~megatron_autohet.runtime.p2p.SchedulePosition` makes
  this the plan's per-stage depth (``role.stage.warmup_microbatches``; the standard depth when the
  plan sets none). No patch of megatron-core is needed on either version; the mechanism, the
  allowed depths and the deadlock-freedom argument are in runtime/p2p.py, enforced by plan
  validation, and tests/runtime/test_schedule.py checks that megatron ran each depth.
* Loss scaling (``forward_step_calc_loss``): on the last stage the first value ``loss_func``
  returns is divided in place by ``num_microbatches`` (the pipeline's own count, which is what is
  passed here) before backward; a 3-tuple ``(loss, num_tokens, ...)`` is also divided by the token
  count. Callers that need the global-batch mean over pipelines of different micro-batch counts
  scale in their ``loss_func`` (runtime/trainer.py does), and must log a detached clone.
"""

from __future__ import annotations

from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining, forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving)
from megatron.core.utils import get_model_config

from megatron_autohet.runtime.p2p import HeteroP2PCommunicator
from megatron_autohet.runtime.stage_model import stage_chunks


def run_schedule(forward_step_func, data_iterator, model, state, *,
                 sequence_parallel: bool = False, forward_only: bool = False,
                 clock=None) -> list:
    """Forward (and backward) of this pipeline's micro-batches on this rank; see module docs."""
    stage = state.role.stage
    common = dict(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                  num_microbatches=stage.num_microbatches, seq_length=state.plan.seq_length,
                  micro_batch_size=state.plan.micro_batch_size, forward_only=forward_only,
                  pg_collection=state.pg_collection)
    if stage.num_stages == 1:
        return forward_backward_no_pipelining(**common)
    chunks = stage_chunks(model)
    communicator = HeteroP2PCommunicator(state.role, get_model_config(chunks[0]),
                                         links=state.p2p_links,
                                         sequence_parallel=sequence_parallel,
                                         forward_only=forward_only, clock=clock)
    if len(chunks) > 1:
        # Every chunk reads each micro-batch once, in megatron's order: one iterator each.
        local = list(data_iterator)
        common.update(model=chunks, data_iterator=[iter(local) for _ in chunks])
        schedule = forward_backward_pipelining_with_interleaving
    else:
        schedule = forward_backward_pipelining_without_interleaving
    losses = schedule(p2p_communicator=communicator, **common)
    communicator.finish_sends()
    return losses
