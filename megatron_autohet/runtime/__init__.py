"""Training from a plan on megatron-core.

topology        pure: each rank's role and the process groups a plan needs (no torch)
cpu_mode        megatron-core on a CPU-only torch with gloo (device mapping, RNG tracker)
parallel_state  this rank's process groups: megatron ProcessGroupCollection + parallel_state globals
stage_model     this rank's stage: megatron-core GPTModel with global layer numbers; ParamLayouts
init            layout-independent initial weights (seeded by global name + full shape)
reference       single-process ground truth: the loss and micro-batch split definitions
optimizer       AdamW with megatron's no-decay rule + megatron-core's LR scheduler (shared)
"""
