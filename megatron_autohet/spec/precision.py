"""The numerics a job trains with: one definition for the cost model, the profiler and the runtime.

The planner prices a plan's memory and time from these figures and the runtime allocates its
tensors from the same ones, so what the cost model charges is what the GPUs hold (torch-free:
the planner imports it without torch).

Megatron-LM's mixed precision (``--bf16`` / ``--fp16``): the layers hold 16-bit weights and
compute 16-bit activations; gradients are accumulated across micro-batches and reduced in fp32
(``main_grad``, ``--accumulate-allreduce-grads-in-fp32``); the optimizer keeps an fp32 master copy
of every weight and fp32 Adam moments, and writes the 16-bit weights back after each step.
In fp32 the weights are their own master copy.

The distributed optimizer (``--use-distributed-optimizer``) shards the master weights and the Adam
moments over the ``D`` replicas that hold a parameter (its data-parallel sync group); the weights
and the fp32 gradient buffer stay whole on every replica (Megatron's ``6 + 12 / D`` bytes per
parameter in bf16 with fp32 gradients is ``2 + 4 + (4 + 8) / D``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Adam's exp_avg and exp_avg_sq, fp32 in every precision.
ADAM_STATE_BYTES = 8
# Megatron accumulates and reduces gradients in fp32 whatever the weights' dtype.
MAIN_GRAD_BYTES = 4


@dataclass(frozen=True)
class Precision:
    name: str                   # "bf16", "fp16" or "fp32": torch dtype name of weights/activations
    element_bytes: int          # one weight or activation element

    @property
    def master_bytes(self) -> int:
        """The fp32 master copy the optimizer keeps beside 16-bit weights (none in fp32)."""
        return 0 if self.element_bytes == 4 else 4

    def state_bytes_per_param(self, optimizer_shards: int = 1) -> float:
        """Weights + fp32 gradient buffer + (master weights + Adam moments) / ``optimizer_shards``
        (1 without the distributed optimizer)."""
        if optimizer_shards < 1:
            raise ValueError(f"optimizer_shards must be >= 1, got {optimizer_shards}")
        return (self.element_bytes + MAIN_GRAD_BYTES
                + (self.master_bytes + ADAM_STATE_BYTES) / optimizer_shards)

    @property
    def optimizer_traffic_bytes_per_param(self) -> int:
        """Bytes an Adam step moves per parameter: read the fp32 gradient, read and write the
        master weight and both moments, write the 16-bit weight (in fp32 the weight is the
        master)."""
        master = 4
        weight_write = 0 if self.element_bytes == 4 else self.element_bytes
        return MAIN_GRAD_BYTES + 2 * master + 2 * ADAM_STATE_BYTES + weight_write


BF16 = Precision("bf16", 2)
FP16 = Precision("fp16", 2)
FP32 = Precision("fp32", 4)
PRECISIONS = {p.name: p for p in (BF16, FP16, FP32)}
# What the runtime trains in: fp16 needs a dynamic loss scaler it does not have, so a profile
# or flag asking for fp16 is refused (GPUs without bf16 train in fp32 or not at all).
TRAINED_PRECISIONS = ("bf16", "fp32")
# What plans are priced for: Megatron-LM GPT training on modern GPUs runs --bf16.
PLANNING_PRECISION = BF16


def default_precision(on_gpu: bool) -> Precision:
    """What a job trains in without --bf16 or --fp16 (and what ``autohet profile`` measures
    in): bf16 on GPUs, as Megatron-LM users train; fp32 on a CPU, where the proofs are exact."""
    return BF16 if on_gpu else FP32
