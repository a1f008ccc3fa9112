"""Training from a plan on megatron-core.

Modules in data-flow order (a rank's start, then one iteration and what it measures of itself;
assembling a job and checkpointing it sit above this package: job.py, checkpoint/; the
single-process reference and stock megatron-core it is checked against are in testing/):

cpu_mode        megatron-core on a CPU-only torch with gloo (device mapping, RNG tracker)
device          a process's CUDA device, in its threads too, and its memory between generations
parallel_state  this rank's process groups: megatron ProcessGroupCollection + parallel_state globals
attention       torch scaled_dot_product_attention as megatron-core core attention (no TE)
fusions         which of megatron-core's jit kernel fusions every rank can run, agreed once
mixed_precision Megatron-LM's bf16 mixed precision: dtypes and fp32 master weights
loss            the training objective: a micro-batch's masked-token-mean cross-entropy
stage_model     this rank's stage: megatron-core GPTModel with global layer numbers; ParamLayouts
init            layout-independent initial weights (seeded by global name + full shape)
p2p             activations and gradients between stages of different TP degrees
schedule        one iteration's forward/backward on megatron-core's pipeline schedules
grad_sync       layer-wise data-parallel gradient sync across pipelines of different shapes
optimizer       AdamW with megatron's no-decay rule + megatron-core's LR scheduler (shared)
distributed_optimizer  --use-distributed-optimizer: Adam state sharded over each bucket's group
trainer         HeteroTrainer: schedule, grad sync and optimizer step of one iteration
iteration_clock where a rank's iteration goes (compute, P2P waits, grad sync, optimizer), no sync
stage_drift     every window: the stages' measured times against the plan's predictions
train_log       Megatron-LM's per-iteration console line (throughput, peak memory) and JSON lines
dashboard       TensorBoard and W&B: iterations as Megatron-LM's scalars, the job's events as text
"""
