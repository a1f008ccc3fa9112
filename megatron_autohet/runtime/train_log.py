"""Per-iteration training logs: Megatron-LM's console line and the same fields as JSON lines.

The console line copies the layout of Megatron-LM's ``training_log`` (megatron/training/
training.py) so tools and eyes used to Megatron read it unchanged - with ``--log-throughput``'s
``throughput per GPU (TFLOP/s/GPU)`` always on - plus tokens per second and, on a GPU, the
largest peak allocated memory of any rank::

     [2026-11-21 10:00:00] iteration        3/      10 | consumed samples:           24 |
     elapsed time per iteration (ms): 312.4 | throughput per GPU (TFLOP/s/GPU): 141.2 | ... |
     tokens per second: 1638.9 | mem-max-allocated-gigabytes: 29.31 |

(one line). Throughput is Megatron-LM's: :func:`num_floating_point_operations` of the global
batch over the iteration's time and every GPU of the job. Peak memory is each rank's
``torch.cuda.max_memory_allocated`` since its process started, read at the iteration's gradient
sync (Megatron-LM's ``mem-max-allocated-bytes``, ``allocated_bytes.all.peak``, in GiB): the
console shows the largest, the JSON line also every rank's
(``mem_max_allocated_gigabytes_per_rank``); on a CPU torch keeps no allocator statistics, so the
console omits it and the JSON fields are ``null``.

A validation loss (``--eval-interval``) is Megatron's evaluation line between dashes, ``
validation loss at iteration N | lm loss value: ... | lm loss PPL: ... |``, and a JSON line
``{"iteration": N, "validation_lm_loss": ..., "validation_ppl": ...}``.

One :class:`IterationRecord` feeds both outputs, so the console and the JSONL file can never
disagree. Only one rank writes (the trainer's metrics are identical on every rank).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from megatron_autohet.spec.model import ModelSpec


def num_floating_point_operations(model: ModelSpec, batch_size: int, seq_length: int,
                                  padded_vocab_size: int) -> float:
    """FLOPs of one iteration over ``batch_size`` sequences, as Megatron-LM core_v0.16.1 counts
    them (megatron/training/training.py ``num_floating_point_operations``, dense GPT: no MoE,
    MTP, MLA or linear attention)::

        B s (  3 * 2 * h * f * m * L                                   MLP
             + 3 * 2 * L * (h (q + 2 k) + q s / 2 * 2 + q h)           self-attention
             + 3 * 2 * h * V )                                         logits

    B sequences of s tokens; L layers of hidden size h and FFN size f; m = 3 with a gated linear
    unit (``--swiglu``), else 2 (the two stacked MLP GEMMs); q = kv_channels * heads (query
    projection), k = kv_channels * query groups (key and value projections); V the padded
    vocabulary. 3 = forward + backward (weight and data gradients), 2 = a multiply-add; the core
    attention's QK^T and (QK^T)V count half the s x s products (causal mask). Norms, softmax and
    the loss are not counted."""
    h, f, L = model.hidden_size, model.ffn_hidden_size, model.num_layers
    kv_channels = h // model.num_attention_heads
    q = kv_channels * model.num_attention_heads
    k = kv_channels * model.num_query_groups
    ffn_gemms = 3 if model.gated_linear_unit else 2
    self_attention = 3 * 2 * (h * (q + 2 * k) + q * seq_length / 2 * 2 + q * h)
    return batch_size * seq_length * (3 * 2 * h * f * ffn_gemms * L
                                      + self_attention * L
                                      + 3 * 2 * h * padded_vocab_size)


@dataclass(frozen=True)
class IterationRecord:
    iteration: int                 # 1-based, as Megatron counts
    train_iters: int
    consumed_samples: int
    elapsed_ms: float              # wall time since the previous iteration ended (logging rank)
    throughput_tflops_per_gpu: float   # Megatron-LM's "throughput per GPU (TFLOP/s/GPU)"
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    grad_norm: float
    tokens_per_second: float
    mem_max_allocated_gigabytes: float | None   # the largest rank's CUDA peak; None on a CPU
    mem_max_allocated_gigabytes_per_rank: list[float] | None     # by rank; None on a CPU
    timestamp: str
    # after an iteration that ends a measurement window (runtime/stage_drift.py): the seconds
    # the logging rank spent on it - the gather of every rank's medians, the drift lines and
    # the window's sinks (measured profile, adapt decision) - which the next iteration's
    # elapsed time holds (every rank waits for this one); None after the other iterations
    window_ms: float | None = None

    @classmethod
    def make(cls, *, iteration: int, train_iters: int, global_batch_size: int, seq_length: int,
             elapsed_s: float, learning_rate: float, lm_loss: float, grad_norm: float,
             flops_per_iteration: float, world_size: int,
             max_allocated_bytes: list[int] | None,
             window_s: float | None = None) -> "IterationRecord":
        """``max_allocated_bytes``: every rank's CUDA peak (runtime/trainer.py StepMetrics), by
        rank; None on a CPU. ``window_s``: the measurement window's seconds after it (the
        field ``window_ms``), None where it ends none."""
        per_rank = (None if max_allocated_bytes is None
                    else [b / 2**30 for b in max_allocated_bytes])
        return cls(iteration=iteration, train_iters=train_iters,
                   consumed_samples=iteration * global_batch_size,
                   elapsed_ms=elapsed_s * 1000.0,
                   throughput_tflops_per_gpu=flops_per_iteration / (elapsed_s * 1e12 * world_size),
                   learning_rate=learning_rate,
                   global_batch_size=global_batch_size, lm_loss=lm_loss, grad_norm=grad_norm,
                   tokens_per_second=global_batch_size * seq_length / elapsed_s,
                   mem_max_allocated_gigabytes=None if per_rank is None else max(per_rank),
                   mem_max_allocated_gigabytes_per_rank=per_rank,
                   timestamp=time.strftime("%Y-%m-%d %H:%M:%S"),
                   window_ms=None if window_s is None else window_s * 1000.0)


def megatron_line(rec: IterationRecord) -> str:
    memory = ("" if rec.mem_max_allocated_gigabytes is None
              else f" mem-max-allocated-gigabytes: {rec.mem_max_allocated_gigabytes:.2f} |")
    return (f" [{rec.timestamp}]"
            f" iteration {rec.iteration:8d}/{rec.train_iters:8d} |"
            f" consumed samples: {rec.consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {rec.elapsed_ms:.1f} |"
            f" throughput per GPU (TFLOP/s/GPU): {rec.throughput_tflops_per_gpu:.1f} |"
            f" learning rate: {rec.learning_rate:.6E} |"
            f" global batch size: {rec.global_batch_size:5d} |"
            f" lm loss: {rec.lm_loss:.6E} |"
            f" grad norm: {rec.grad_norm:.3f} |"
            f" tokens per second: {rec.tokens_per_second:.1f} |" + memory)


class IterationLogger:
    """Prints the Megatron line (where ``console``); appends the record to ``metrics_jsonl``
    when given (a new file, or the end of an existing one with ``append``), and each
    measurement window to ``measured_jsonl`` likewise. ``dashboard`` (runtime/dashboard.py,
    TensorBoard and W&B) gets every record and validation loss too; its owner closes it."""

    def __init__(self, metrics_jsonl: str | Path | None = None, stream: TextIO | None = None,
                 append: bool = False, measured_jsonl: str | Path | None = None,
                 dashboard=None):
        self._stream = stream
        self._dashboard = dashboard
        mode = "a" if append else "w"
        self._jsonl = open(metrics_jsonl, mode) if metrics_jsonl else None
        self._measured = open(measured_jsonl, mode) if measured_jsonl else None

    def log(self, rec: IterationRecord, console: bool = True) -> None:
        if console:
            print(megatron_line(rec), file=self._stream, flush=True)
        if self._jsonl:
            self._jsonl.write(json.dumps(asdict(rec)) + "\n")
            self._jsonl.flush()
        if self._dashboard is not None:
            self._dashboard.log(rec)

    def log_validation(self, iteration: int, lm_loss: float) -> None:
        ppl = math.exp(min(20.0, lm_loss))          # Megatron caps the exponent the same way
        line = (f" validation loss at iteration {iteration} | lm loss value: {lm_loss:.6E} |"
                f" lm loss PPL: {ppl:.6E} | ")
        rule = "-" * (len(line) + 1)
        print(f"{rule}\n{line}\n{rule}", file=self._stream, flush=True)
        if self._dashboard is not None:
            self._dashboard.log_validation(iteration, lm_loss, ppl)
        if self._jsonl:
            self._jsonl.write(json.dumps({"iteration": iteration, "validation_lm_loss": lm_loss,
                                          "validation_ppl": ppl}) + "\n")
            self._jsonl.flush()

    def log_measured(self, report) -> None:
        """A measurement window (runtime/stage_drift.py ``WindowReport``): a line per stage off
        its prediction, and the window as one JSON line."""
        for line in report.lines():
            print(f" measured {line}", file=self._stream, flush=True)
        if self._measured:
            self._measured.write(json.dumps(report.to_dict()) + "\n")
            self._measured.flush()

    def close(self) -> None:
        for jsonl in (self._jsonl, self._measured):
            if jsonl:
                jsonl.close()
        if self._dashboard is not None:
            self._dashboard.flush()
