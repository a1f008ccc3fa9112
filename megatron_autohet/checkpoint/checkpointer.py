"""The checkpoint hook of a training job: resume at start, save every ``--save-interval``.

``Checkpointer(options, trainer, scheduler, *, seed, train_args)`` is built on every rank after
the trainer (it creates the job's checkpoint process group, so every rank must build it);
``resume()`` returns where training starts (iteration 0 without a checkpoint),
``after_iteration(iteration)`` saves when the interval says so and ``finish(iteration)`` saves
the last iteration if it was not just saved (Megatron-LM does the same at the end of training)
and waits for the background work.

A save:

1. Snapshot: this rank's model weights, Adam moments and RNG states copied to host memory
   (``clone`` on a CPU; device-to-host on a GPU), with the common state. This is the only part
   training waits for with ``--async-save``.
2. Write (checkpoint/writer.py) and commit the step in the local tier, keep the newest
   ``--autohet-keep-ckpts``, then upload it to S3 (checkpoint/upload.py) when configured.
   With ``--async-save`` this runs in a background thread on a process group of its own
   (gloo), so its collectives never interleave with training's; the next save first waits for
   the previous one (on every rank alike).

A save that fails - a full disk, S3 unreachable - is reported on every rank as a WARNING and
training goes on; the next interval tries again with a new step. Nothing partial is committed
(checkpoint/manifest.py), so a failed save costs the progress since the last good one, never a
corrupt resume.

Each save's timings are kept in ``save_times`` (:class:`SaveTimes`, the background part filled
in when it is done) and logged with it; a resume's bytes and seconds per tier are in
``last_report`` (checkpoint/recovery.py) and logged.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megatron_autohet.checkpoint.manifest import remove_old_steps, step_dir_name
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.checkpoint.state import (RNG_KEY, TrainingProgress, common_state,
                                               SnapshotBuffers, rank_sharded_state_dict,
                                               rng_sharded_object, snapshot)
from megatron_autohet.checkpoint.writer import StepDirs, write_step
from megatron_autohet.errors import ConfigError
from megatron_autohet.runtime.device import enter_device, thread_device

# Collectives of a save wait at most this long for a peer (a dead peer fails the save instead of
# hanging the background writer forever).
CHECKPOINT_GROUP_TIMEOUT = timedelta(minutes=10)


@dataclass
class SaveTimes:
    """Seconds one save took on this rank. On the training thread: ``waited_s`` for the previous
    save's background work, ``build_s`` building the sharded state dict, ``snapshot_s`` copying
    it to host memory, and ``blocked_s`` all that training waited (the three included). Then
    ``write_s`` (write and commit in the local tier) and ``upload_s`` (S3), in the background
    with --async-save; None until done, or when there was nothing to do."""
    iteration: int
    waited_s: float = 0.0
    build_s: float = 0.0
    snapshot_s: float = 0.0
    blocked_s: float = 0.0
    write_s: float | None = None
    upload_s: float | None = None


def _log(message: str) -> None:
    print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", flush=True)


class Checkpointer:
    def __init__(self, options: CheckpointOptions, trainer, scheduler, *, seed: int,
                 train_args: dict, schedule_flags: dict | None = None):
        self.options = options
        self.trainer = trainer
        self.scheduler = scheduler
        self.seed = seed
        self.train_args = train_args
        self.schedule_flags = schedule_flags       # scheduler field -> the flag that sets it
        self.plan = trainer.plan
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dirs = self._save_dirs()
        self.device = thread_device()       # the writer thread's CUDA device (None: CPU)
        self.snapshot_buffers = SnapshotBuffers()    # pinned host memory, reused every save
        self.group = dist.new_group(backend="gloo", timeout=CHECKPOINT_GROUP_TIMEOUT)
        self.s3 = None
        if options.s3_uri is not None:
            from megatron_autohet.checkpoint.s3_store import S3Store
            self.s3 = S3Store(options.s3_uri, endpoint_url=options.s3_endpoint_url)
        self.last_saved: int | None = None
        self.last_report = None                 # RecoveryReport of resume(), if it loaded
        self.save_times: list[SaveTimes] = []
        self.failed_saves: list[int] = []
        self.failed_uploads: list[int] = []
        self._writer: threading.Thread | None = None

    def _save_dirs(self) -> StepDirs | None:
        if self.options.local_dir is not None:
            return StepDirs.per_node(self.options.local_dir, self.plan)
        if self.options.save is not None:
            return StepDirs.shared(self.options.save, self.world_size)
        return None

    def _readable_roots(self) -> list[Path]:
        roots = []
        if self.dirs is not None:
            roots.append(self.dirs.root(self.rank))
        if self.options.load is not None:
            roots.append(StepDirs.per_node(self.options.load, self.plan).root(self.rank))
        return list(dict.fromkeys(roots))

    def _log0(self, message: str) -> None:
        if self.rank == 0:
            _log(message)

    # ---- resume ---------------------------------------------------------------------------

    def resume(self) -> TrainingProgress:
        """Load the newest complete step (checkpoint/recovery.py; ``--ckpt-step``: that one),
        or start at iteration 0. A step this job cannot take as the flags say (``--ckpt-step``
        committed nowhere, another schedule without --override-/--use-checkpoint-opt-param-
        scheduler) is a :class:`ConfigError` naming the flag, the same on every rank."""
        from megatron_autohet.checkpoint.recovery import recover
        from megatron_autohet.checkpoint.state import ScheduleMismatch
        from megatron_autohet.runtime.optimizer import SCHEDULE_CHOICE, SCHEDULE_FLAGS

        start = TrainingProgress(iteration=0, consumed_train_samples=0)
        if self.options.load is None:
            return start
        try:
            result = recover(self.trainer, self.scheduler, roots=self._readable_roots(),
                             s3=self.s3, group=self.group, log=self._log0,
                             options=self.options)
        except ScheduleMismatch as err:
            flags = self.schedule_flags or SCHEDULE_FLAGS
            raise ConfigError("<command line>", flags[err.field], str(err),
                              SCHEDULE_CHOICE) from None
        if result is None:
            self._log0(f"WARNING: no complete checkpoint in {self.options.load}"
                       + (f" or {self.options.s3_uri}" if self.s3 else "")
                       + "; training from scratch")
            return start
        progress, report = result
        self.last_report = report
        self._log0(f"successfully loaded checkpoint: {report.line()}")
        skipped = [what for what, flag in (
            ("iteration, consumed samples, Adam state, schedule and RNG states "
             "(--finetune: training starts at iteration 1)", self.options.finetune),
            ("Adam state and learning-rate schedule (--no-load-optim)",
             self.options.no_load_optim and not self.options.finetune),
            ("RNG states (--no-load-rng)", self.options.no_load_rng and not self.options.finetune))
            if flag]
        if skipped:
            self._log0("not loaded: " + "; ".join(skipped))
        self.last_saved = progress.iteration
        return progress

    # ---- save -----------------------------------------------------------------------------

    def after_iteration(self, iteration: int) -> None:
        interval = self.options.save_interval
        if self.dirs is not None and interval and iteration % interval == 0:
            self.save(iteration)

    def finish(self, iteration: int) -> None:
        if self.dirs is not None and iteration > 0 and self.last_saved != iteration:
            self.save(iteration)
        self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is done."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def save(self, iteration: int) -> None:
        times = SaveTimes(iteration)
        start = time.perf_counter()
        self.wait()
        times.waited_s = time.perf_counter() - start
        t = time.perf_counter()
        progress = TrainingProgress(iteration=iteration, consumed_train_samples=iteration
                                    * self.plan.global_batch_size)
        state_dict = rank_sharded_state_dict(self.trainer)
        state_dict[RNG_KEY] = rng_sharded_object(self.trainer, self.world_size)
        times.build_s = time.perf_counter() - t
        t = time.perf_counter()
        state_dict = snapshot(state_dict, self.snapshot_buffers)
        times.snapshot_s = time.perf_counter() - t
        common = common_state(self.trainer, self.scheduler, progress, seed=self.seed,
                              train_args=self.train_args)
        self.last_saved = iteration
        self.save_times.append(times)
        self._log0(f"saving checkpoint at iteration {iteration:7d} to "
                   f"{self.dirs.root(self.rank)} in torch_dist format"
                   + (" (in the background)" if self.options.async_save else ""))
        if self.options.async_save:
            self._writer = threading.Thread(target=self._write, args=(state_dict, common,
                                                                      iteration, times),
                                            name=f"autohet-checkpoint-{iteration}", daemon=True)
            self._writer.start()
        else:
            self._write(state_dict, common, iteration, times)
        times.blocked_s = time.perf_counter() - start

    def _write(self, state_dict: dict, common: dict, iteration: int, times: SaveTimes) -> None:
        from megatron_autohet.checkpoint.upload import upload_step
        from megatron_autohet.checkpoint.writer import SaveFailed
        from megatron_autohet.runtime.cpu_mode import cpu_mode_thread

        enter_device(self.device)
        root = self.dirs.root(self.rank)
        start = time.perf_counter()
        with cpu_mode_thread():
            try:
                manifest = write_step(state_dict, common, iteration=iteration, plan=self.plan,
                                      rank=self.rank, dirs=self.dirs, group=self.group)
                if self.dirs.is_leader(self.rank):
                    remove_old_steps(root, self.options.keep)
                times.write_s = time.perf_counter() - start
                self._log0(f"successfully saved checkpoint from iteration {iteration:7d} to "
                           f"{root} ({manifest.total_bytes / 2**20:.1f} MiB; state dict "
                           f"{times.build_s:.2f} s, copy to host memory {times.snapshot_s:.2f} "
                           f"s, waiting for the previous save {times.waited_s:.2f} s; written "
                           f"in {times.write_s:.2f} s)")
            except SaveFailed as err:
                self.failed_saves.append(iteration)
                self._log0(f"WARNING: checkpoint of iteration {iteration} failed, training "
                           f"goes on and the next interval saves again: {err}")
                return
            if self.s3 is None:
                return
            t = time.perf_counter()
            try:
                committed = upload_step(self.s3, manifest, root / step_dir_name(iteration),
                                        rank=self.rank, keep=self.options.keep, group=self.group)
                times.upload_s = time.perf_counter() - t
                if committed:
                    self._log0(f"uploaded iteration {iteration} to {self.s3.location.uri()} "
                               f"({times.upload_s:.2f} s)")
            except SaveFailed as err:
                self.failed_uploads.append(iteration)
                self._log0(f"WARNING: upload of iteration {iteration} failed (the local "
                           f"checkpoint is complete; the next save uploads again): {err}")
