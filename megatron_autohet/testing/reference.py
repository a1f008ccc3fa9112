"""The single-process reference every parallel layout must reproduce.

Public API
----------
``run_reference(model_spec, global_batches, *, micro_batch_size, seed, optimizer,
                padded_vocab, sequence_parallel=False, final_params=None,
                eval_batches=None, precision=FP32) -> list[ReferenceStep]``
    Trains the whole model (TP1, PP1) in this process for one iteration per global batch with
    ``optimizer`` (an ``OptimizerSettings``: AdamW, weight decay, clipping and the learning-rate
    schedule over ``len(global_batches)`` iterations) and returns each iteration's
    ``ReferenceStep(loss, grad_norm, learning_rate)``; the grad norm is taken before clipping, as
    the runtime reports it, the learning rate is the one the iteration used. ``final_params``: a
    dict to fill with the trained parameters, full tensors keyed by global name (tests compare every
    layout's final weights; in a 16-bit precision the fp32 master weights). ``precision``
    (spec/precision.py): bf16 runs Megatron's mixed precision as the runtime does (below).
    ``eval_batches``: {iteration: validation global batches}; after that (1-based) iteration the
    step's ``eval_loss`` is the forward-only mean loss over their micro-batches.
``reference_plan(model_spec, *, micro_batch_size, num_microbatches, seq_length) -> Plan``
    The one-rank plan the reference trains.
Global batch: dict of ``data.batches.BATCH_KEYS`` (``tokens``, ``labels``, ``loss_mask``,
``position_ids``) tensors, each ``[global_batch_size, seq]``; the reference trains on whole
batches (``GlobalBatch.tensors()``), split into micro-batches by ``data.batches.microbatches`` as
the runtime splits them.

Design (why)
------------
* Same code path, no second model definition: the reference is a one-rank plan built with
  ``build_parallel_state`` + ``build_stage_model`` - megatron-core's GPTModel with every layer and
  the layout-independent initial weights of ``runtime/init.py``. Any parallel run of the same
  model and seed starts from TP/PP slices of exactly these weights. ``padded_vocab`` must be the
  parallel plan's (``stage_model.plan_padded_vocab_size``): padding rows enter the softmax.
* The objective is the runtime's own (runtime/loss.py ``masked_token_mean``, checked against an
  independent cross-entropy by the objective tests); what the reference writes out separately is the
  parallel machinery it must not share: no pipeline, no TP, no gradient sync. The optimizer and
  schedule come from runtime/optimizer.py (``make_optimizer``: AdamW with megatron's no-decay rule
  on global names; ``make_lr_scheduler``: megatron-core's OptimizerParamScheduler), which the
  runtime and the stock baseline use too; it holds no parallel logic. Iteration loss = mean over ALL
  micro-batches of the global batch of the masked-token-mean cross-entropy; gradients = the
  gradient of that (each micro-batch's backward is scaled by 1/M and accumulated); grad norm and
  clipping with megatron-core's ``get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32``.
* Mixed precision, written out here and not taken from runtime/grad_sync.py: the model is built
  in the precision's dtype; after each micro-batch's backward every gradient is added into an
  fp32 main gradient and freed (Megatron's ``main_grad`` accumulation); norm and clipping are
  taken on the fp32 main gradients; AdamW steps the fp32 master weights of
  runtime/mixed_precision.py (whose ``.grad`` are the main gradients) and the 16-bit weights are
  written back from them. In fp32 the same loop accumulates in fp32 into an fp32 buffer, exactly
  the sums autograd's own accumulation would make.
* It needs its own process (world size 1): if ``torch.distributed`` is not initialised it starts a
  one-rank gloo world on an in-memory store and tears it down afterwards; tests call it through
  ``run_on_ranks(1, ...)`` (tests/helpers/dist_utils.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_autohet.data.batches import microbatches
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.runtime.loss import masked_token_mean
from megatron_autohet.runtime.mixed_precision import MAIN_GRAD_DTYPE, MasterWeights
from megatron_autohet.runtime.optimizer import (OptimizerSettings, make_lr_scheduler,
                                                make_optimizer)
from megatron_autohet.runtime.parallel_state import build_parallel_state
from megatron_autohet.runtime.stage_model import build_stage_model, param_layouts
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import FP32, Precision


@dataclass(frozen=True)
class ReferenceStep:
    loss: float
    grad_norm: float
    learning_rate: float        # the rate this iteration's optimizer step used
    eval_loss: float | None = None  # validation loss after the iteration, where asked


def reference_plan(model_spec: ModelSpec, *, micro_batch_size: int, num_microbatches: int,
                   seq_length: int) -> Plan:
    return Plan(cluster="reference", model=model_spec, micro_batch_size=micro_batch_size,
                global_batch_size=micro_batch_size * num_microbatches, seq_length=seq_length,
                ranks=[RankInfo(rank=0, node="reference", local_rank=0, gpu="reference")],
                pipelines=[Pipeline(stages=[Stage(ranks=[0], layers=(0, model_spec.num_layers))],
                                    num_microbatches=num_microbatches)]).validate("<reference>")


def run_reference(model_spec: ModelSpec, global_batches, *, micro_batch_size: int, seed: int,
                  optimizer: OptimizerSettings, padded_vocab: int,
                  sequence_parallel: bool = False,
                  final_params: dict | None = None,
                  eval_batches: dict[int, list[dict]] | None = None,
                  precision: Precision = FP32) -> list[ReferenceStep]:
    own_world = not dist.is_initialized()
    if own_world:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("run_reference needs a process of its own (world size 1), got world "
                           f"size {dist.get_world_size()}")
    try:
        return _train(model_spec, list(global_batches), micro_batch_size, seed, optimizer,
                      padded_vocab, sequence_parallel, final_params, eval_batches or {},
                      precision)
    finally:
        if own_world:
            # megatron-core: on first use, not with this module
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def _train(model_spec, global_batches, micro_batch_size, seed, settings, padded_vocab,
           sequence_parallel, final_params, eval_batches, precision) -> list[ReferenceStep]:
    # megatron-core: on first use, not with this module
    from megatron.core.optimizer.clip_grads import (clip_grad_by_total_norm_fp32,
                                                    get_grad_norm_fp32)

    if not global_batches:
        return []
    global_size, seq_length = global_batches[0]["tokens"].shape
    if global_size % micro_batch_size:
        raise ValueError(f"global batch of {global_size} rows is not a multiple of "
                         f"micro_batch_size {micro_batch_size}")
    num_microbatches = global_size // micro_batch_size
    plan = reference_plan(model_spec, micro_batch_size=micro_batch_size,
                          num_microbatches=num_microbatches, seq_length=seq_length)
    state = build_parallel_state(plan, 0)
    model = build_stage_model(model_spec, state, seed=seed, padded_vocab=padded_vocab,
                              sequence_parallel=sequence_parallel, precision=precision)
    model.train()
    params = list(model.parameters())
    for param in params:
        param.main_grad = torch.zeros(param.shape, dtype=MAIN_GRAD_DTYPE)
    layouts = param_layouts(model, state)
    masters = MasterWeights(model.named_parameters(), precision)
    optimizer = make_optimizer(model, layouts, settings, masters)
    scheduler = make_lr_scheduler(optimizer, settings, len(global_batches), global_size)
    steps = []
    for global_batch in global_batches:
        for param in params:
            param.main_grad.zero_()
            param.grad = None                  # fp32: the master's .grad, i.e. the main_grad
        total = 0.0
        for batch in microbatches(global_batch, micro_batch_size, 0, num_microbatches):
            per_token = model(batch["tokens"], batch["position_ids"], None,
                              labels=batch["labels"])
            loss = masked_token_mean(per_token, batch["loss_mask"])
            (loss / num_microbatches).backward()
            total += loss.item()
            with torch.no_grad():
                for param in params:
                    if param.grad is not None:
                        param.main_grad.add_(param.grad)
                        param.grad = None
        masters.use_main_grads()           # an fp32 parameter is its master: its .grad was freed
        grad_norm = float(get_grad_norm_fp32([p.main_grad for p in params]))
        if settings.clip_grad > 0:
            clip_grad_by_total_norm_fp32(masters.tensors, settings.clip_grad, grad_norm)
        learning_rate = optimizer.param_groups[0]["lr"]
        optimizer.step()
        masters.write_back()
        scheduler.step(global_size)            # megatron counts samples
        eval_loss = None
        if len(steps) + 1 in eval_batches:
            eval_loss = _forward_loss(model, eval_batches[len(steps) + 1], micro_batch_size)
        steps.append(ReferenceStep(loss=total / num_microbatches, grad_norm=grad_norm,
                                   learning_rate=learning_rate, eval_loss=eval_loss))
    if final_params is not None:
        final_params.update({layouts[name].global_name: master.detach().clone()
                             for name, master in masters.by_name.items()})
    return steps


def _forward_loss(model, global_batches: list[dict], micro_batch_size: int) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for global_batch in global_batches:
            count = global_batch["tokens"].shape[0] // micro_batch_size
            for batch in microbatches(global_batch, micro_batch_size, 0, count):
                per_token = model(batch["tokens"], batch["position_ids"], None,
                                  labels=batch["labels"])
                losses.append(masked_token_mean(per_token, batch["loss_mask"]).item())
    model.train()
    return sum(losses) / len(losses)
