"""TensorBoard and W&B: every iteration's record as Megatron-LM's scalars, the job's events as text.

``--tensorboard-dir DIR`` (both front ends: ``autohet train``'s flag, Megatron-LM's own on
``pretrain_gpt.py --autohet-plan``) writes TensorBoard event files with the scalar names of
Megatron-LM core_v0.16.1's ``training_log`` (megatron/training/training.py), each on the
iteration axis and, where Megatron-LM has one, also against consumed samples (``<name> vs
samples``)::

    lm loss, learning-rate, batch-size, grad-norm      (and each "... vs samples")
    iteration-time                                     seconds (Megatron's interval time)
    throughput                                         TFLOP/s/GPU (Megatron's --log-throughput)
    tokens-per-second                                  the global batch's tokens / iteration-time
    mem-max-allocated-bytes                            the largest rank's CUDA peak (GPU only)
    lm loss validation, lm loss validation ppl         with --eval-interval (and "vs samples")

Megatron-LM writes ``iteration-time`` and ``throughput`` only with ``--log-timers-to-tensorboard``,
the memory only with ``--log-memory-to-tensorboard`` and the perplexity only with
``--log-validation-ppl-to-tensorboard``; here every one is written at every iteration, as the
console line always shows throughput (``--tensorboard-log-interval`` is Megatron's default, 1).
``tokens-per-second`` is this package's (the console line's ``tokens per second``). The values are
those of the iteration's :class:`~megatron_autohet.runtime.train_log.IterationRecord`, the same
as the console line and the ``--metrics-jsonl`` line: one record feeds all three.

The job's events - an elastic job's (elastic/events.py: plan, re-plan, fleet, stop on a notice,
saved, recovery, ...) and the checkpoints' lines (saved, loaded, uploaded, warnings) - are text
entries (``add_text``, tag ``events/<event>``) on the same step axis: the iteration this
process is at (trained, or being logged, saved, measured), or, for an event before its first
one (a restart's plan and fleet), the iteration it resumes from - each written just before that
first iteration's scalars, so the steps of an event file never go back (TensorBoard drops what
lies after a step that went back: a resumed run's orphaned iterations).

W&B (``--wandb-project``, ``--wandb-exp-name``, ``--wandb-save-dir``, Megatron-LM's flags) logs
the same scalars and the events (as ``wandb.Html``) on the same steps; it needs the ``wandb``
package, which is not a dependency: without it the flag is refused before any process starts.

One rank writes: the rank that logs (the plan's rank 0; an elastic job's reporting rank). A
:class:`Dashboard` opens its writers at its first entry, so a process that never reports leaves
no file, and flushes after every iteration. A job that switches plans in its processes
(plan_switch.py) keeps one dashboard across its plans: one event file, one W&B run. Where the
logging rank moves to another process, the one that wrote so far closes its writers and hands
them over (:meth:`Dashboard.handover`): the next process appends to the same event file (a
TensorBoard event file is a sequence of records, read as one file whoever appended them) and
resumes the same W&B run (``wandb.init(id=..., resume="must")``).
"""

from __future__ import annotations

import html
import importlib.util
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_autohet.errors import ConfigError

# The flags, as both front ends spell them (Megatron-LM's names; --wandb-entity is not taken).
FLAGS = {"tensorboard_dir": "--tensorboard-dir", "wandb_project": "--wandb-project",
         "wandb_exp_name": "--wandb-exp-name", "wandb_save_dir": "--wandb-save-dir"}


@dataclass(frozen=True)
class DashboardOptions:
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard_dir or self.wandb_project)

    def validate(self, source: str = "<command line>") -> "DashboardOptions":
        """Before any process: the TensorBoard directory can be created (or is a writable
        directory) and its writer can be imported; W&B is installed where asked for, and its
        other flags come with ``--wandb-project``. ConfigError naming the flag."""
        if self.tensorboard_dir:
            _check_creatable_dir(self.tensorboard_dir, FLAGS["tensorboard_dir"], source)
            if importlib.util.find_spec("tensorboard") is None:
                raise ConfigError(source, FLAGS["tensorboard_dir"], "the tensorboard package "
                                  "is not installed (torch.utils.tensorboard needs it)",
                                  "pip install tensorboard (a dependency of megatron-autohet)")
        if self.wandb_project:
            if importlib.util.find_spec("wandb") is None:
                raise ConfigError(source, FLAGS["wandb_project"], f"{self.wandb_project!r}: "
                                  "wandb is not installed", "pip install wandb, or no "
                                  "--wandb-project (--tensorboard-dir needs no account)")
            if self.wandb_save_dir:
                _check_creatable_dir(self.wandb_save_dir, FLAGS["wandb_save_dir"], source)
        else:
            for field in ("wandb_exp_name", "wandb_save_dir"):
                if getattr(self, field):
                    raise ConfigError(source, FLAGS[field], f"{getattr(self, field)!r} without "
                                      "--wandb-project", "with --wandb-project NAME only")
        return self


def _check_creatable_dir(path: str, flag: str, source: str) -> None:
    """``path`` is a directory this process can write to, or can be made one: its nearest
    existing ancestor is a writable directory."""
    target = Path(path).expanduser().absolute()
    existing = target
    while not existing.exists():
        existing = existing.parent
    if existing == target and not target.is_dir():
        raise ConfigError(source, flag, f"{path}: not a directory", "a directory (created if "
                          "missing)")
    if not existing.is_dir():
        raise ConfigError(source, flag, f"{path}: {existing} is not a directory",
                          "a directory (created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(source, flag, f"{path}: {existing} is not writable",
                          "a directory this user can write to")


def dashboard_flags() -> list[tuple[tuple[str, ...], dict]]:
    """``autohet train``'s flags (Megatron-LM's parser has them already)."""
    return [
        (("--tensorboard-dir",), dict(default=None, help="write TensorBoard event files here "
                                      "(Megatron-LM's scalar names, every iteration; the job's "
                                      "events as text), from the rank that logs")),
        (("--wandb-project",), dict(default=None, help="log the same to this W&B project "
                                    "(needs `pip install wandb`)")),
        (("--wandb-exp-name",), dict(default=None, help="the W&B run's name (default: W&B's)")),
        (("--wandb-save-dir",), dict(default=None, help="W&B's local files (default: SAVE/wandb "
                                     "with --save, else W&B's ./wandb)")),
    ]


def dashboard_options(args) -> DashboardOptions:
    """The options from either front end's parsed flags (Megatron-LM's empty-string defaults
    are None)."""
    return DashboardOptions(**{field: getattr(args, field, None) or None for field in FLAGS})


class _EventFile:
    """One TensorBoard event file, new or continued: tensorboard's records (the Event protocol
    buffer, torch's scalar and text summaries), written at once, flushed on demand."""

    def __init__(self, path: str, new: bool):
        # tensorboard's record format and torch's summaries: only in the rank that logs
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter
        from torch.utils.tensorboard.summary import scalar, text

        self.path, self._event, self._scalar, self._text = path, Event, scalar, text
        self._records = RecordWriter(open(path, "ab"))
        if new:
            self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event) -> None:
        self._records.write(event.SerializeToString())

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._write(self._event(wall_time=time.time(), step=step,
                                summary=self._scalar(tag, value)))

    def add_text(self, tag: str, message: str, step: int) -> None:
        self._write(self._event(wall_time=time.time(), step=step,
                                summary=self._text(tag, message)))

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        self._records.close()


class Dashboard:
    """The writers of one process (see the module doc); ``config``: the run's settings for W&B,
    ``wandb_dir``: its directory when ``--wandb-save-dir`` is not given; ``continues``: what
    another process's :meth:`handover` returned, whose event file and W&B run this one goes on
    writing."""

    def __init__(self, options: DashboardOptions, *, config: dict | None = None,
                 wandb_dir: str | None = None, continues: dict | None = None):
        self.options = options
        self.config = config or {}
        self.wandb_dir = wandb_dir
        self.continues = continues or {}
        self._tb: _EventFile | None = None
        self._wandb = None
        self._opened = False
        self.step: int | None = None          # the last iteration logged by this process
        self._pending: list[tuple[str, str]] = []     # events before the first iteration
        # consumed samples of the last iteration logged
        self._samples = self.continues.get("samples", 0)

    def _open(self) -> None:
        if self._opened:
            return
        self._opened = True
        if self.options.tensorboard_dir:
            path = self.continues.get("event_file")
            if path is None:        # TensorBoard's own naming
                Path(self.options.tensorboard_dir).mkdir(parents=True, exist_ok=True)
                path = str(Path(self.options.tensorboard_dir) / (
                    f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                    f"{os.getpid()}"))
            self._tb = _EventFile(path, new="event_file" not in self.continues)
        if self.options.wandb_project:
            # wandb: an optional package (validate refuses the flag without it)
            import wandb
            save_dir = self.options.wandb_save_dir or self.wandb_dir
            if save_dir:
                Path(save_dir).mkdir(parents=True, exist_ok=True)
            self._wandb = wandb
            run = self.continues.get("wandb_run")
            wandb.init(project=self.options.wandb_project, name=self.options.wandb_exp_name,
                       dir=save_dir, config=self.config,
                       **({"id": run, "resume": "must"} if run else {}))

    def handover(self) -> dict:
        """Close this process's writers for the process that logs next (module doc): what its
        :class:`Dashboard` ``continues``."""
        state = {"samples": self._samples}
        if self._tb is not None:
            state["event_file"] = self._tb.path
        elif "event_file" in self.continues:
            state["event_file"] = self.continues["event_file"]
        if self._wandb is not None:
            state["wandb_run"] = self._wandb.run.id
        elif "wandb_run" in self.continues:
            state["wandb_run"] = self.continues["wandb_run"]
        self.close()
        return state

    def _scalars(self, values: dict[str, float], step: int) -> None:
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def at(self, iteration: int) -> None:
        """Iteration ``iteration`` is trained: events from here on (its window's, its save's)
        go on its step; those before this process's first iteration go on the one before."""
        if self.step is None:               # the events before it: at the iteration resumed
            self.step = iteration - 1
            if self._pending:
                self._open()
                self._write_pending()
        self.step = max(self.step, iteration)

    def log(self, rec) -> None:
        """One iteration (runtime/train_log.py ``IterationRecord``)."""
        self._open()
        self.at(rec.iteration)
        it, samples = rec.iteration, rec.consumed_samples
        self._samples = samples
        both = {"lm loss": rec.lm_loss, "learning-rate": rec.learning_rate,
                "batch-size": rec.global_batch_size, "grad-norm": rec.grad_norm}
        values = {**both, "iteration-time": rec.elapsed_ms / 1000.0,
                  "throughput": rec.throughput_tflops_per_gpu,
                  "tokens-per-second": rec.tokens_per_second}
        if rec.mem_max_allocated_gigabytes is not None:
            values["mem-max-allocated-bytes"] = rec.mem_max_allocated_gigabytes * 2**30
        self._scalars(values, it)
        if self._tb is not None:            # W&B plots any key against samples itself
            for name, value in both.items():
                self._tb.add_scalar(f"{name} vs samples", value, samples)
        self.flush()

    def log_validation(self, iteration: int, lm_loss: float, ppl: float) -> None:
        """A validation loss, after iteration ``iteration``'s record."""
        self._open()
        consumed_samples = self._samples
        self.step = iteration if self.step is None else max(self.step, iteration)
        self._scalars({"lm loss validation": lm_loss, "lm loss validation ppl": ppl}, iteration)
        if self._tb is not None:
            self._tb.add_scalar("lm loss validation vs samples", lm_loss, consumed_samples)
            self._tb.add_scalar("lm loss validation ppl vs samples", ppl, consumed_samples)

    def event(self, event: str, message: str) -> None:
        """One of the job's events (elastic/events.py, the checkpoints' lines) as text at the
        iteration this process is at; before its first, held until it (module doc)."""
        self._open()
        self._pending.append((event, message))
        if self.step is not None:
            self._write_pending()
            self.flush()

    def _write_pending(self) -> None:
        pending, self._pending = self._pending, []
        for event, message in pending:
            if self._tb is not None:
                self._tb.add_text(f"events/{event}", message, self.step)
            if self._wandb is not None:
                self._wandb.log({f"events/{event}": self._wandb.Html(
                    f"<pre>{html.escape(message)}</pre>")}, step=self.step)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """At the process's end: events still held go at the iteration it resumed from (0:
        none), then the files are closed."""
        if self._pending:
            self.step = self.step or 0
            self._write_pending()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def open_dashboard(options: DashboardOptions, *, config: dict | None = None,
                   wandb_dir: str | None = None, continues: dict | None = None
                   ) -> Dashboard | None:
    """A :class:`Dashboard` where the options ask for one, else None."""
    return (Dashboard(options, config=config, wandb_dir=wandb_dir, continues=continues)
            if options.enabled else None)
