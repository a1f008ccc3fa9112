"""Training from a plan on megatron-core.

Modules in data-flow order (a rank's start, one iteration, then the baselines it is checked with;
assembling a job and checkpointing it sit above this package: job.py, checkpoint/):

cpu_mode        megatron-core on a CPU-only torch with gloo (device mapping, RNG tracker)
parallel_state  this rank's process groups: megatron ProcessGroupCollection + parallel_state globals
attention       torch scaled_dot_product_attention as megatron-core core attention (no TE)
stage_model     this rank's stage: megatron-core GPTModel with global layer numbers; ParamLayouts
init            layout-independent initial weights (seeded by global name + full shape)
p2p             activations and gradients between stages of different TP degrees
schedule        one iteration's forward/backward on megatron-core's pipeline schedules
grad_sync       layer-wise data-parallel gradient sync across pipelines of different shapes
optimizer       AdamW with megatron's no-decay rule + megatron-core's LR scheduler (shared)
distributed_optimizer  --use-distributed-optimizer: Adam state sharded over each bucket's group
trainer         HeteroTrainer: schedule, grad sync and optimizer step of one iteration
train_log       Megatron-LM's per-iteration console line (throughput, peak memory) and JSON lines
reference       single-process ground truth: the loss and micro-batch split definitions
stock           stock megatron-core on a homogeneous plan: the baseline of tests and benchmarks
"""
