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
   ``--autohet-keep-ckpts``, then upload it to S3 (checkpoint/upload.py) when configured -
   until ``stop_uploading()`` (a preemption notice with a deadline).
   With ``--async-save`` this runs in a background thread on a process group of its own
   (gloo), so its collectives never interleave with training's; without it the write and commit
   run on the training thread and only the upload goes to that thread (a slow S3 never stalls
   training). A save due while the previous one is still being written or uploaded is skipped
   (one line; the next interval saves): the ranks agree on that with a one-integer all-reduce
   on a second gloo group (``decisions``), never the writer's. The last save of the run
   (``finish``) waits for the previous one instead, and a last save whose upload failed ends
   the job (status 1: the durable copy asked for is not there).

A save that fails - a full disk, S3 unreachable - fails on every rank alike (checkpoint/
writer.py), leaves no ``iter_N.partial`` behind and is reported in one line by rank 0 with its
root cause (checkpoint/failures.py), the traceback going to ``autohet-checkpoint-errors.log`` in
the checkpoint directory. Training goes on and the next interval tries again with a new step,
unless the save was the last of the run or the ``--autohet-max-failed-saves``-th in a row: then
rank 0 says which steps are complete and where, and every rank raises :class:`CheckpointStop`
(a ``SystemExit``, status 1). With ``--async-save`` the training thread learns the outcome when
it next waits for the writer (the next save or ``finish``), so every rank decides alike. A
failed S3 upload of a complete local step is a WARNING only, as is a step another save has
committed in S3 already (its files are never replaced, checkpoint/upload.py). Nothing partial is
committed (checkpoint/manifest.py), so a failed save costs the progress since the last good one,
never a corrupt resume.

Each save's timings are kept in ``save_times`` (:class:`SaveTimes`, the background part filled
in when it is done) and logged with it; a resume's bytes and seconds per tier are in
``last_report`` (checkpoint/recovery.py) and logged. ``on_line(event, line)``: every line rank
0 logs goes there too (the job's dashboard, runtime/dashboard.py: ``save``, ``recovery`` or
``checkpoint`` text entries); it may be called from the writer thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_autohet.checkpoint.failures import log_traceback, root_cause
from megatron_autohet.checkpoint.lease import Lease, rank_owner_name, take_job_lease
from megatron_autohet.checkpoint.manifest import (LATEST_FILE, committed_steps, remove_old_steps,
                                                  step_dir_name, write_atomic)
from megatron_autohet.checkpoint.options import CheckpointOptions, object_store
from megatron_autohet.checkpoint.recovery import recover
from megatron_autohet.checkpoint.sources import RankPlaces
from megatron_autohet.checkpoint.state import (RNG_KEY, ScheduleMismatch, SnapshotBuffers,
                                               TrainingProgress, common_state,
                                               rank_sharded_state_dict, rng_sharded_object,
                                               snapshot)
from megatron_autohet.checkpoint.upload import GIVEN_UP, upload_step
from megatron_autohet.checkpoint.writer import SaveFailed, StepDirs, on_every_rank, write_step
from megatron_autohet.errors import ConfigError, JobConfigError
from megatron_autohet.runtime.cpu_mode import cpu_mode_thread
from megatron_autohet.runtime.device import enter_device, thread_device
from megatron_autohet.runtime.optimizer import SCHEDULE_CHOICE, SCHEDULE_FLAGS
from megatron_autohet.spec.cluster import Cluster

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


@dataclass
class SaveFailure:
    """A save that failed: the line's cause (every rank's root causes, or this rank's) and where
    this rank's traceback went (None: nowhere could take it)."""
    cause: str
    log: Path | None


class CheckpointStop(SystemExit):
    """The job stops because saving failed (the last save, or too many in a row), on every rank
    alike; rank 0 has printed why (``line``: why, and which steps are complete where, as this
    rank sees them). Exit status 1, no traceback; an elastic worker stops its job for good with
    the line (elastic/worker.py)."""

    def __init__(self, line: str):
        super().__init__(1)
        self.line = line


def _log(message: str, *, file=None) -> None:
    print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", file=file or sys.stdout,
          flush=True)


class Checkpointer:
    def __init__(self, options: CheckpointOptions, trainer, scheduler, *, seed: int,
                 train_args: dict, schedule_flags: dict | None = None, keep_lease: bool = False,
                 on_line=None, cluster: Cluster | None = None):
        self.options = options
        self.on_line = on_line
        self.trainer = trainer
        self.scheduler = scheduler
        self.seed = seed
        self.train_args = train_args
        self.schedule_flags = schedule_flags       # scheduler field -> the flag that sets it
        self.plan = trainer.plan
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # On a fleet across zones (``cluster``: the plan's nodes with their zones), recovery
        # asks the peers of a rank's own zone first and counts what crosses zones.
        self.places = (RankPlaces(cluster, tuple(r.node for r in self.plan.ranks))
                       if cluster is not None and cluster.regions else None)
        self.dirs = self._save_dirs()
        self.device = thread_device()       # the writer thread's CUDA device (None: CPU)
        self.snapshot_buffers = SnapshotBuffers()    # pinned host memory, reused every save
        self.group = dist.new_group(backend="gloo", timeout=CHECKPOINT_GROUP_TIMEOUT)
        # The training thread's own agreements (is the background save done?), while the writer
        # thread may be in a collective on ``group``.
        self.decisions = dist.new_group(backend="gloo", timeout=CHECKPOINT_GROUP_TIMEOUT)
        self.s3 = object_store(options)
        self.keep_lease = keep_lease
        self.lease = self._take_lease() if options.saving else None
        self.last_saved: int | None = None
        self.last_report = None                 # RecoveryReport of resume(), if it loaded
        self.save_times: list[SaveTimes] = []
        self.failed_saves: list[int] = []
        self.upload_errors: dict[int, str] = {}     # a failed upload's cause, by iteration
        self.skipped_saves: list[int] = []
        self.uploaded: list[int] = []
        self._give_up = threading.Event()        # stop_uploading()
        self.consecutive_failures = 0
        self._writer: threading.Thread | None = None
        self._writing: int | None = None         # the iteration the latest save wrote
        self._uploading: int | None = None       # a synchronous save's background upload
        self._pending_upload: tuple | None = None
        self._failure: SaveFailure | None = None  # its failure, until the training thread reads it

    @property
    def failed_uploads(self) -> list[int]:
        return list(self.upload_errors)

    def _save_dirs(self) -> StepDirs | None:
        if self.options.local_dir is not None:
            return StepDirs.per_node(self.options.local_dir, self.plan)
        if self.options.save is not None:
            return StepDirs.shared(self.options.save, self.world_size)
        return None

    def _take_lease(self) -> Lease:
        """The writer lease of this rank's part of the job's locations (its directory where it is
        the directory's leader, the S3 prefix on rank 0), for the job's owner name (the
        launcher's, or one rank 0 makes); refused on every rank alike (JobConfigError) when any
        rank finds another live owner (checkpoint/lease.py)."""
        owner = [self.options.owner or rank_owner_name()]
        dist.broadcast_object_list(owner, src=0, group=self.group)
        roots = [self.dirs.root(self.rank)] if self.dirs.is_leader(self.rank) else []
        refused, lease = None, Lease([], owner[0])
        try:
            lease = take_job_lease(self.options, roots, owner[0],
                                   with_store=self.s3 is not None and self.rank == 0,
                                   warn=_log)
        except ConfigError as err:
            refused = (err.field, err.problem, err.allowed)
        found = [None] * self.world_size
        dist.all_gather_object(found, refused, group=self.group)
        first = next((f for f in found if f is not None), None)
        if first is not None:
            lease.release()
            raise JobConfigError("<command line>", *first)
        return lease

    def _readable_roots(self) -> list[Path]:
        roots = []
        if self.dirs is not None:
            roots.append(self.dirs.root(self.rank))
        if self.options.load is not None:
            roots.append(StepDirs.per_node(self.options.load, self.plan).root(self.rank))
        return list(dict.fromkeys(roots))

    def _log0(self, message: str, event: str = "checkpoint") -> None:
        if self.rank == 0:
            _log(message)
            if self.on_line is not None:
                self.on_line(event, message)

    # ---- resume ---------------------------------------------------------------------------

    def resume(self) -> TrainingProgress:
        """Load the newest complete step (checkpoint/recovery.py; ``--ckpt-step``: that one),
        or start at iteration 0. A step this job cannot take as the flags say (``--ckpt-step``
        committed nowhere, another schedule without --override-/--use-checkpoint-opt-param-
        scheduler, no step at all with ``--exit-on-missing-checkpoint``) is a JobConfigError
        naming the flag, raised on every rank alike and printed once by the job."""
        progress = self._resume()
        if self.dirs is not None:
            self._set_aside_newer_steps(progress.iteration)
        return progress

    def _set_aside_newer_steps(self, start: int) -> None:
        """A committed step is never replaced: steps in this job's save directories newer than
        the iteration it starts from (a --ckpt-step back in time, a newer step recovery could
        not use) are renamed ``iter_N.set-aside-<time>`` before this run saves those numbers
        again (one line); a run that trains from scratch without --load over a directory holding
        steps is refused (JobConfigError: most likely a --load forgotten)."""
        root = self.dirs.root(self.rank)
        newer = ([i for i in committed_steps(root) if i > start]
                 if self.dirs.is_leader(self.rank) else [])
        found = [None] * self.world_size
        dist.all_gather_object(found, (str(root), newer), group=self.group)
        found = {where: steps for where, steps in found if steps}
        if not found:
            return
        listed = "; ".join(f"{where}: {', '.join(map(str, steps))}"
                           for where, steps in found.items())
        if self.options.load is None:
            flag = "--autohet-local-ckpt-dir" if self.options.local_dir else "--save"
            raise JobConfigError("<command line>", flag, f"committed checkpoint steps are there "
                                 f"({listed}) and this run trains from scratch (no --load)",
                                 "--load naming them (resume from the newest), another "
                                 "directory, or removing them: a committed step is never "
                                 "replaced")
        suffix = f".set-aside-{time.strftime('%Y%m%d-%H%M%S')}"

        def set_aside():
            for iteration in newer:
                step = root / step_dir_name(iteration)
                os.replace(step, step.with_name(step.name + suffix))
            if newer:
                steps = committed_steps(root)
                if steps:
                    write_atomic(root / LATEST_FILE, str(steps[-1]).encode())
        on_every_rank(set_aside, self.group, "setting aside newer steps")
        self._log0(f"WARNING: this run starts from iteration {start}, and its save directories "
                   f"hold newer committed steps ({listed}): set aside as iter_N{suffix} (not "
                   "loaded, not replaced by this run's saves of the same iterations)")

    def _resume(self) -> TrainingProgress:
        start = TrainingProgress(iteration=0, consumed_train_samples=0)
        if self.options.load is None:
            return start
        try:
            result = recover(self.trainer, self.scheduler, roots=self._readable_roots(),
                             s3=self.s3, group=self.group, log=self._log0,
                             options=self.options, places=self.places)
        except ScheduleMismatch as err:
            flags = self.schedule_flags or SCHEDULE_FLAGS
            raise JobConfigError("<command line>", flags[err.field], str(err),
                                 SCHEDULE_CHOICE) from None
        if result is None and self.options.exit_on_missing_checkpoint:
            raise JobConfigError("<command line>", "--load",
                                 f"no complete checkpoint in {self.options.load}"
                                 + (f" or {self.options.s3_uri}" if self.s3 else ""),
                                 "a directory holding one, as --exit-on-missing-checkpoint is set")
        if result is None:
            self._log0(f"WARNING: no complete checkpoint in {self.options.load}"
                       + (f" or {self.options.s3_uri}" if self.s3 else "")
                       + "; training from scratch")
            return start
        progress, report = result
        self.last_report = report
        self._log0(f"successfully loaded checkpoint: {report.line()}", "recovery")
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
        if self.dirs is None or not interval or iteration % interval:
            return
        if self._previous_save_running():
            self.skipped_saves.append(iteration)
            busy = (f"{self._writing} is still being written" if self._writing is not None
                    else f"{self._uploading} is still being uploaded")
            self._log0(f"skipping the checkpoint of iteration {iteration}: the one of iteration "
                       f"{busy} (the next interval saves)")
            return
        self.save(iteration)

    def finish(self, iteration: int, *, completed: bool = True) -> None:
        """The last save of the run: waits for the background save (back-pressure does not
        apply), saves ``iteration`` unless that is already done, and waits for it; a failure of
        it stops the job (:class:`CheckpointStop`), and so does, when the job's training is
        ``completed`` (not a stop for a notice or a plan switch), an upload of it that failed."""
        self.wait()
        if self.dirs is not None and iteration > 0 and (
                self.last_saved != iteration or self.failed_saves[-1:] == [iteration]):
            self.save(iteration, last=True)
            self.wait(last=True)
        if completed and self.s3 is not None and self.last_saved in self.upload_errors:
            # the user asked for a durable copy of the run's end: a local one alone is no exit 0
            line = (f"the last checkpoint (iteration {self.last_saved}) did not reach "
                    f"{self.s3.location.uri()}: {self.upload_errors[self.last_saved]}; the job "
                    f"ends with status 1. {self._complete_steps()}")
            if self.rank == 0:
                _log(f"ERROR: {line}", file=sys.stderr)
            dist.barrier(group=self.decisions)
            raise CheckpointStop(line)

    def wait(self, *, last: bool = False) -> None:
        """Block until the background save (if any) is done, then act on its outcome."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        self._settle(last)

    def _previous_save_running(self) -> bool:
        """Whether the background save is still writing on any rank (the same answer on every
        rank: each rank's thread finishes at its own time)."""
        if self._writer is None:
            return False
        running = torch.tensor([int(self._writer.is_alive())])
        dist.all_reduce(running, op=dist.ReduceOp.MAX, group=self.decisions)
        return bool(running.item())

    def save(self, iteration: int, *, last: bool = False) -> None:
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
        self._writing = iteration
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
            self._settle(last)
            if self._pending_upload is not None:
                upload, self._pending_upload = self._pending_upload, None
                self._uploading = iteration
                self._writer = threading.Thread(target=self._upload_in_background, args=upload,
                                                name=f"autohet-upload-{iteration}", daemon=True)
                self._writer.start()
        times.blocked_s = time.perf_counter() - start

    def _write(self, state_dict: dict, common: dict, iteration: int, times: SaveTimes) -> None:
        """Write, commit and upload one step, in the writer thread with --async-save. Catches
        every exception (torch's CheckpointException is a BaseException; a thread that dies
        prints a traceback and reports nothing, one that raises SystemExit not even that): the
        failure waits in ``_failure`` for the training thread."""
        root = self.dirs.root(self.rank)
        try:
            enter_device(self.device)
            with cpu_mode_thread():
                self._write_step(state_dict, common, iteration, times, root)
        except BaseException as err:
            if isinstance(err, SaveFailed):
                cause = str(err)
            else:                                   # outside the agreed phases: this rank's
                cause = f"{root_cause(err)} (rank {self.rank})"
            text = "".join(traceback.format_exception(err))
            self._failure = SaveFailure(cause,
                                        log_traceback(root, f"iteration {iteration}, rank "
                                                      f"{self.rank}:\n{text}"))
            if isinstance(err, (KeyboardInterrupt, SystemExit)) and not self.options.async_save:
                raise                               # the training thread's own interruption

    def _write_step(self, state_dict: dict, common: dict, iteration: int, times: SaveTimes,
                    root: Path) -> None:
        start = time.perf_counter()
        manifest = write_step(state_dict, common, iteration=iteration, plan=self.plan,
                              rank=self.rank, dirs=self.dirs, group=self.group,
                              before_commit=self.lease.check if self.lease else None)
        times.write_s = time.perf_counter() - start
        self._log0(f"successfully saved checkpoint from iteration {iteration:7d} to "
                   f"{root} ({manifest.total_bytes / 2**20:.1f} MiB; state dict "
                   f"{times.build_s:.2f} s, copy to host memory {times.snapshot_s:.2f} "
                   f"s, waiting for the previous save {times.waited_s:.2f} s; written "
                   f"in {times.write_s:.2f} s)", "save")
        try:
            on_every_rank(lambda: remove_old_steps(root, self.options.keep)
                          if self.dirs.is_leader(self.rank) else None, self.group,
                          f"removing steps older than the newest {self.options.keep} in {root}")
        except SaveFailed as err:                   # the step itself is complete
            self._log0(f"WARNING: {err}")
        if self.s3 is None:
            return
        if self.options.async_save:
            self._upload(manifest, iteration, times, root)      # in the writer thread already
        else:               # the training thread goes on: the upload runs in the background
            self._pending_upload = (manifest, iteration, times, root)

    def _upload_in_background(self, manifest, iteration: int, times: SaveTimes,
                              root: Path) -> None:
        """A synchronous save's upload, in a thread of its own (as --async-save's writer: the
        next save waits for it, a save due meanwhile is skipped). Anything it raises is a failed
        upload (a WARNING; the last save's ends the job in ``finish``), never lost."""
        try:
            enter_device(self.device)
            with cpu_mode_thread():
                self._upload(manifest, iteration, times, root)
        except BaseException as err:  # noqa: BLE001 - a thread that dies reports nothing
            self.upload_errors[iteration] = f"{root_cause(err)} (rank {self.rank})"
            log = log_traceback(root, f"iteration {iteration}, rank {self.rank}:\n"
                                + "".join(traceback.format_exception(err)))
            self._log0(f"WARNING: uploading iteration {iteration} failed: "
                       f"{self.upload_errors[iteration]} ({_traceback_where(log)})")

    def _upload(self, manifest, iteration: int, times: SaveTimes, root: Path) -> None:
        t = time.perf_counter()
        try:
            done = upload_step(self.s3, manifest, root / step_dir_name(iteration),
                               rank=self.rank, keep=self.options.keep, group=self.group,
                               give_up=self._give_up)
        except SaveFailed as err:
            self.upload_errors[iteration] = str(err)
            log = log_traceback(root, f"iteration {iteration}, rank {self.rank}:\n"
                                + "".join(traceback.format_exception(err)))
            self._log0(f"WARNING: {err}; the local checkpoint of iteration {iteration} is "
                       f"complete and the next save uploads again ({_traceback_where(log)})")
            return
        if done.taken:
            self._log0(f"WARNING: iteration {iteration} is not uploaded to "
                       f"{self.s3.location.uri()}: another save committed it there already "
                       f"({done.taken}), and its files are not replaced; the local checkpoint "
                       f"of iteration {iteration} is complete")
            return
        if done.skipped:
            self._log0(f"upload of iteration {iteration} to {self.s3.location.uri()} given up: "
                       f"{GIVEN_UP}")
            return
        times.upload_s = time.perf_counter() - t
        self.uploaded.append(iteration)
        if done.committed:
            self._log0(f"uploaded iteration {iteration} to {self.s3.location.uri()} "
                       f"({times.upload_s:.2f} s)")

    def close(self, *, completed: bool) -> None:
        """The end of this run's training (however it ended): the heartbeat stops and the
        writer lease is given back - except with ``keep_lease`` before the job is done: an
        elastic job's workers, whose next round takes it again, and a plan switch
        (``--autohet-adapt replan``), whose next plan's checkpointer does (until then it stays
        theirs, fresh for lease.DEFAULT_STALE_S)."""
        if self.lease is None:
            return
        if completed or not self.keep_lease:
            self.lease.release()
        else:
            self.lease.stop_heartbeat()

    def stop_uploading(self) -> None:
        """A preemption notice with a deadline: no save uploads any more - one uploading in the
        background gives up, the notice's own is written locally only (each says so);
        elastic/worker.py sends what must go to S3 after moving the files to the peers."""
        self._give_up.set()

    def _settle(self, last: bool) -> None:
        """On the training thread, once the latest save is done on every rank: count its failure
        and report it in one line (rank 0); stop the job after the last save of the run or
        ``max_failed_saves`` failures in a row. Every rank reads the same outcome (a save fails
        on all of them alike)."""
        failure, self._failure = self._failure, None
        if self._writing is None:
            return
        iteration, self._writing = self._writing, None
        if failure is None:
            self.consecutive_failures = 0
            return
        self.failed_saves.append(iteration)
        self.consecutive_failures += 1
        limit = self.options.max_failed_saves
        line = (f"checkpoint of iteration {iteration} failed: {failure.cause} "
                f"({_traceback_where(failure.log)})")
        lost = torch.tensor([int(self.lease is not None and self.lease.lost is not None)])
        dist.all_reduce(lost, op=dist.ReduceOp.MAX, group=self.decisions)
        if lost.item():
            last = True                     # another job writes here now: no save may follow
        if not last and self.consecutive_failures < limit:
            self._log0(f"WARNING: {line}; training goes on and the next interval saves again "
                       f"({self.consecutive_failures} of --autohet-max-failed-saves {limit} "
                       "failures in a row)")
            return
        why = ("another job took over its checkpoint lease" if lost.item() else
               "it was the last save of the run" if last else
               f"{self.consecutive_failures} saves in a row failed (--autohet-max-failed-saves "
               f"{limit})")
        line = f"{line}; the job stops: {why}. {self._complete_steps()}"
        if self.rank == 0:
            _log(f"ERROR: {line}", file=sys.stderr)
        dist.barrier(group=self.decisions)      # rank 0 has printed before any rank exits
        raise CheckpointStop(line)

    def _complete_steps(self) -> str:
        root = self.dirs.root(self.rank)
        steps = committed_steps(root)
        where = (f"complete steps in {root}: {', '.join(map(str, steps))}" if steps
                 else f"no complete step in {root}")
        if self.s3 is not None:
            where += (f"; newest uploaded to {self.s3.location.uri()} by this run: "
                      f"{self.uploaded[-1]}" if self.uploaded
                      else f"; none uploaded to {self.s3.location.uri()} by this run")
        return where[0].upper() + where[1:]


def _traceback_where(log: Path | None) -> str:
    return f"traceback in {log}" if log else "no traceback file: nowhere to write it"
