"""Per-iteration training logs: Megatron-LM's console line and the same fields as JSON lines.

The console line copies the layout of Megatron-LM's ``training_log`` (megatron/training/
training.py) so tools and eyes used to Megatron read it unchanged, plus tokens per second::

     [2026-11-21 10:00:00] iteration        3/      10 | consumed samples:           24 | ...

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


@dataclass(frozen=True)
class IterationRecord:
    iteration: int                 # 1-based, as Megatron counts
    train_iters: int
    consumed_samples: int
    elapsed_ms: float              # wall time of this iteration on the logging rank
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    grad_norm: float
    tokens_per_second: float
    timestamp: str

    @classmethod
    def make(cls, *, iteration: int, train_iters: int, global_batch_size: int, seq_length: int,
             elapsed_s: float, learning_rate: float, lm_loss: float,
             grad_norm: float) -> "IterationRecord":
        return cls(iteration=iteration, train_iters=train_iters,
                   consumed_samples=iteration * global_batch_size,
                   elapsed_ms=elapsed_s * 1000.0, learning_rate=learning_rate,
                   global_batch_size=global_batch_size, lm_loss=lm_loss, grad_norm=grad_norm,
                   tokens_per_second=global_batch_size * seq_length / elapsed_s,
                   timestamp=time.strftime("%Y-%m-%d %H:%M:%S"))


def megatron_line(rec: IterationRecord) -> str:
    return (f" [{rec.timestamp}]"
            f" iteration {rec.iteration:8d}/{rec.train_iters:8d} |"
            f" consumed samples: {rec.consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {rec.elapsed_ms:.1f} |"
            f" learning rate: {rec.learning_rate:.6E} |"
            f" global batch size: {rec.global_batch_size:5d} |"
            f" lm loss: {rec.lm_loss:.6E} |"
            f" grad norm: {rec.grad_norm:.3f} |"
            f" tokens per second: {rec.tokens_per_second:.1f} |")


class IterationLogger:
    """Prints the Megatron line (where ``console``); appends the record to ``metrics_jsonl`` when given (a new file,
    or the end of an existing one with ``append``)."""

    def __init__(self, metrics_jsonl: str | Path | None = None, stream: TextIO | None = None,
                 append: bool = False):
        self._stream = stream
        self._jsonl = open(metrics_jsonl, "a" if append else "w") if metrics_jsonl else None

    def log(self, rec: IterationRecord, console: bool = True) -> None:
        if console:
            print(megatron_line(rec), file=self._stream, flush=True)
        if self._jsonl:
            self._jsonl.write(json.dumps(asdict(rec)) + "\n")
            self._jsonl.flush()

    def log_validation(self, iteration: int, lm_loss: float) -> None:
        ppl = math.exp(min(20.0, lm_loss))          # Megatron caps the exponent the same way
        line = (f" validation loss at iteration {iteration} | lm loss value: {lm_loss:.6E} |"
                f" lm loss PPL: {ppl:.6E} | ")
        rule = "-" * (len(line) + 1)
        print(f"{rule}\n{line}\n{rule}", file=self._stream, flush=True)
        if self._jsonl:
            self._jsonl.write(json.dumps({"iteration": iteration, "validation_lm_loss": lm_loss,
                                          "validation_ppl": ppl}) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
