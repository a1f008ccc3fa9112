"""The stock megatron-core baseline for a homogeneous plan.

The equivalence tests (tests/runtime/test_equivalence.py, tests/runtime/test_stage_model.py) and the
runtime benchmark (scripts/bench_runtime.py) compare our runtime against what megatron-core does on
its own when the plan is one regular TP x PP x DP grid. This module is that baseline, written once.

Public API
----------
``StockMegatronTrainer(plan, *, rank, seed, optimizer, distributed_optimizer=False,
                       precision=FP32, jit_fusions=None, fused_optimizer=None)``
    ``torch.distributed`` must be initialised with the plan's world size. Builds, with
    megatron-core's own machinery only: ``parallel_state.initialize_model_parallel``, a
    ``GPTModel`` of this rank's stage (the runtime's layer spec, runtime/stage_model.py
    ``stage_layer_spec``: the same attention as ours) on the current CUDA device (the CPU in
    CPU mode), ``DistributedDataParallel`` with its
    contiguous grad buffers, ``finalize_model_grads`` (DP all-reduce, tied-embedding all-reduce)
    as the schedule's finalize hook, ``get_megatron_optimizer`` (AdamW with megatron's own
    parameter groups and no-decay rule, megatron's grad-norm clipping; hyper-parameters from the
    ``OptimizerSettings``; with ``distributed_optimizer`` megatron-core's DistributedOptimizer,
    which runs on gloo too) and ``get_forward_backward_func`` (megatron's own P2P and 1F1B).
    ``precision`` bf16 is Megatron-LM's ``--bf16``: the model wrapped in megatron-core's
    ``Float16Module``, DDP with ``grad_reduce_in_fp32`` (fp32 main grads) and
    ``get_megatron_optimizer(bf16=True)`` (``Float16OptimizerWithFloat16Params``, or with
    ``distributed_optimizer`` its DistributedOptimizer on fp32 master shards). ``jit_fusions``:
    megatron-core's fused kernels, agreed as the runtime agrees them (runtime/fusions.py).
    ``fused_optimizer`` (None: on CUDA, as the runtime decides, runtime/optimizer.py
    ``fused_adamw``): megatron's AdamW steps with torch's fused kernel, the one-pass update
    Megatron-LM gets from Transformer Engine's or Apex's FusedAdam on a GPU; megatron-core
    0.16.1 without them builds torch's AdamW with its default (foreach) implementation and has no
    option for the kernel, so its groups' ``fused`` switch is set after it is built.
    ``.optimizer`` is megatron's optimizer (``.megatron_optimizers`` its members where megatron
    chains several): a learning-rate scheduler
    (``optimizer.make_lr_scheduler``) drives its ``param_groups`` exactly as it drives ours.
    ``train_step(global_batch) -> StockStep`` runs one iteration; ``close()`` destroys megatron's
    parallel state (so a different runtime can run in the same process afterwards).
``StockStep(losses, grad_norm)``: this rank's micro-batch losses (last stages; empty elsewhere)
    and megatron's grad norm before clipping.

What is ours, and why: the initial weights are the layout-independent ones of runtime/init.py
(copied in before DDP wraps the model), the loss and global-batch split are
testing/reference.py's, and the AdamW hyper-parameters (weight decay included) are the same
``OptimizerSettings`` our runtime gets. Which parameters are decayed is decided by megatron's own
``_get_param_groups`` here (biases and 1-D parameters are not), by runtime/optimizer.py's
``applies_weight_decay`` in ours: the same rule, so with weight decay on, a matching run also
shows the two rules agree. So stock megatron-core, our runtime and the single-process reference
train the same model on the same data with the same objective and optimizer, and any difference
is the system's. Everything that moves data between ranks is megatron's.

"Homogeneous" means what megatron can express: every pipeline has the same stages (layer ranges,
one TP degree for the whole plan, the standard 1F1B warm-up) and the same micro-batch count
(megatron DDP averages over DP), and ranks are placed in megatron's default order (tp-cp-ep-dp-pp:
global rank = tp_rank + tp * pipeline + tp * dp * stage). Anything else is a ValueError before a
group is created.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch

from megatron_autohet.data.batches import microbatches
from megatron_autohet.layout.topology import rank_role
from megatron_autohet.plan import Plan
from megatron_autohet.runtime.fusions import agree_jit_fusions
from megatron_autohet.runtime.init import initialize_parameters
from megatron_autohet.runtime.loss import masked_token_mean
from megatron_autohet.runtime.mixed_precision import param_dtype
from megatron_autohet.runtime.optimizer import OptimizerSettings, fused_adamw
from megatron_autohet.runtime.stage_model import (model_device, param_layouts,
                                                  plan_padded_vocab_size, stage_layer_spec,
                                                  transformer_config)
from megatron_autohet.spec.precision import FP32, Precision


@dataclass(frozen=True)
class StockStep:
    losses: list[float]       # this rank's micro-batch losses (last stages), else []
    grad_norm: float          # megatron's global grad norm, before clipping


def check_homogeneous(plan: Plan) -> None:
    """ValueError unless megatron-core's single grid can run ``plan`` as planned (module doc)."""
    first = plan.pipelines[0]
    shape = [(s.layers, s.tp) for s in first.stages]
    tp = first.stages[0].tp
    for p, pipeline in enumerate(plan.pipelines):
        if [(s.layers, s.tp) for s in pipeline.stages] != shape:
            raise ValueError(f"pipeline {p} has other stages than pipeline 0: not homogeneous")
        if pipeline.num_microbatches != first.num_microbatches:
            raise ValueError(f"pipeline {p} runs {pipeline.num_microbatches} micro-batches, "
                             f"pipeline 0 {first.num_microbatches}: megatron DDP needs equal "
                             "counts")
    if any(s.tp != tp for s in first.stages):
        raise ValueError("stages differ in TP degree: megatron has one TP size")
    if first.warmup_depths() != first.standard_warmup_depths():
        raise ValueError("the plan sets its own 1F1B warm-up depths: megatron's schedule has "
                         "only the standard ones")
    dp = len(plan.pipelines)
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            expected = [t + tp * p + tp * dp * s for t in range(tp)]
            if list(stage.ranks) != expected:
                raise ValueError(f"pipeline {p} stage {s} has ranks {list(stage.ranks)}; "
                                 f"megatron's default order places {expected} there")


class StockMegatronTrainer:
    """One rank of stock megatron-core training a homogeneous plan (see module doc)."""

    def __init__(self, plan: Plan, *, rank: int, seed: int, optimizer: OptimizerSettings,
                 distributed_optimizer: bool = False, precision: Precision = FP32,
                 jit_fusions: dict[str, bool] | None = None,
                 fused_optimizer: bool | None = None):
        # megatron-core: on first use, not with this module
        from megatron.core import parallel_state as mps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        check_homogeneous(plan)
        self.plan = plan
        self.role = role = rank_role(plan, rank)
        stages = plan.pipelines[0].stages
        tp = stages[0].tp
        mps.destroy_model_parallel()      # whatever was installed before (e.g. our runtime's)
        mps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                      pipeline_model_parallel_size=len(stages))
        grid = (mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank(),
                mps.get_data_parallel_rank())
        if grid != (role.tp_rank, role.stage.stage, role.stage.pipeline):
            raise RuntimeError(f"rank {rank}: megatron placed it at (tp, pp, dp) = {grid}, the "
                               f"plan at {(role.tp_rank, role.stage.stage, role.stage.pipeline)}")
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self.fusions = agree_jit_fusions(jit_fusions or {}, model_device())
        config = transformer_config(plan.model, tp, pipeline_layers=[s.layers for s in stages],
                                    precision=precision, **self.fusions.config_fields())
        # The runtime's layer (Transformer Engine's, or megatron's local layer with torch SDPA as
        # core attention): comparisons are of the systems, not of two attention kernels.
        model = GPTModel(config, stage_layer_spec(config)[0],
                         vocab_size=plan_padded_vocab_size(plan),
                         max_sequence_length=plan.model.seq_length,
                         pre_process=mps.is_pipeline_first_stage(),
                         post_process=mps.is_pipeline_last_stage(),
                         share_embeddings_and_output_weights=plan.model.tie_embeddings)
        # local name (of the unwrapped GPTModel) -> ParamLayout
        self.layouts = layouts = param_layouts(model, SimpleNamespace(plan=plan, role=role))
        initialize_parameters(((p, layouts[n]) for n, p in model.named_parameters()),
                              plan.model, seed)
        # Megatron-LM's get_model: on the GPU before the 16-bit wrapper (which refuses CPU
        # parameters when CUDA is there); the batches follow the model.
        self.device = model_device()
        model.to(self.device)
        mixed = bool(precision.master_bytes)
        if mixed:       # Megatron-LM's get_model: the 16-bit module casts inputs and outputs
            model = Float16Module(config, model)
        # distributed_optimizer: megatron-core's own DistributedOptimizer (--use-distributed-
        # optimizer) over its one DP group, for comparisons with ours
        self.model = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                                  grad_reduce_in_fp32=mixed),
            model)
        config.finalize_model_grads_func = finalize_model_grads
        optimizer.validate()
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=optimizer.lr, min_lr=optimizer.min_lr,
                            weight_decay=optimizer.weight_decay, decoupled_weight_decay=True,
                            adam_beta1=optimizer.adam_beta1, adam_beta2=optimizer.adam_beta2,
                            adam_eps=optimizer.adam_eps, clip_grad=optimizer.clip_grad,
                            use_distributed_optimizer=distributed_optimizer,
                            bf16=precision.name == "bf16", params_dtype=param_dtype(precision)),
            [self.model])
        # Megatron builds every group with weight_decay = config.weight_decay and leaves applying
        # the group's wd_mult to its scheduler's first step; do it now so the optimizer is right
        # with or without a scheduler (a scheduler writes the same value again).
        for group in self.optimizer.param_groups:
            group["weight_decay"] = optimizer.weight_decay * group["wd_mult"]
        # The runtime's AdamW kernel (module doc); torch reads a group's switches at each step.
        self.fused_optimizer = fused_adamw(self.device, fused_optimizer)
        if self.fused_optimizer:
            for megatron_optimizer in self.megatron_optimizers:
                for group in megatron_optimizer.optimizer.param_groups:
                    group["fused"], group["foreach"] = True, False

    @property
    def megatron_optimizers(self) -> list:
        """The optimizers megatron built (a ChainedOptimizer's members, else the one)."""
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def train_step(self, global_batch: dict) -> StockStep:
        # megatron-core: on first use, not with this module
        from megatron.core.pipeline_parallel import get_forward_backward_func

        plan, role = self.plan, self.role
        count = role.stage.num_microbatches
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        local = microbatches(global_batch, plan.micro_batch_size, role.microbatch_offset, count)
        losses = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, self.device), data_iterator=iter(local),
            model=[self.model],
            num_microbatches=count, seq_length=plan.seq_length,
            micro_batch_size=plan.micro_batch_size, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron's optimizer skipped the step (non-finite gradients)")
        # one host sync for the losses (megatron's step has read the grad norm already), as
        # our trainer: a float() per micro-batch would slow the baseline on a GPU
        losses = torch.stack([x["lm loss"] for x in losses]).tolist() if losses else []
        return StockStep(losses=losses, grad_norm=grad_norm)

    def close(self) -> None:
        # megatron-core: on first use, not with this module
        from megatron.core import parallel_state as mps
        mps.destroy_model_parallel()


def _loss_func(loss_mask, per_token_loss):
    loss = masked_token_mean(per_token_loss, loss_mask)
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(device, data_iterator, model):
    batch = {key: value.to(device, non_blocking=True)
             for key, value in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])
