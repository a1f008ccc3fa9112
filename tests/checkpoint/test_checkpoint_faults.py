"""Checkpoint failures are never silent: real faults on real files, two gloo ranks.

A full disk is a size-limited tmpfs (skipped where this process may not mount one); the job is
``train_iterations`` with the :class:`Checkpointer`, the loop ``autohet train`` runs. Every case
checks what the user sees: one line with the root cause, printed once, no Python traceback on the
console, the traceback in the log file, and nothing partial left on the disk.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron_autohet.checkpoint.failures import ERROR_LOG
from megatron_autohet.checkpoint.manifest import PARTIAL_SUFFIX, committed_steps
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.plan import load_plan, plan_from_dict
from megatron_autohet.runtime.optimizer import OptimizerSettings
from helpers.dist_utils import RankFailed, run_on_ranks
from helpers.training import global_batches

PLANS = Path(__file__).resolve().parents[2] / "configs" / "plans"
SEED = 1234
SCHEDULE_ITERS = 8          # one learning-rate schedule for every run, so any run resumes any
OPTIMIZER = OptimizerSettings(lr=3e-3, weight_decay=0.1, clip_grad=1.0)


def two_ranks():
    """tiny-homogeneous cut to one pipeline of two stages on two nodes (the cheapest real job)."""
    data = load_plan(PLANS / "tiny-homogeneous.yaml").to_dict()
    data["ranks"] = [data["ranks"][0], dict(data["ranks"][2], rank=1)]
    data["pipelines"] = [{"num_microbatches": 4,
                          "stages": [{"ranks": [0], "layers": [0, 3]},
                                     {"ranks": [1], "layers": [3, 6]}]}]
    return plan_from_dict(data, "<two ranks>")


PLAN = two_ranks()


class Batches:
    def __init__(self, batches):
        self.batches = batches

    def batch(self, iteration):
        return self.batches[iteration]


def _job(rank, world, options, total, patch=None):
    """Train ``total`` iterations with ``options``; what the checkpointer saw, and the exit code
    of a CheckpointStop (0 without one). ``patch(rank, checkpointer)`` injects a fault."""
    from megatron_autohet.checkpoint.checkpointer import Checkpointer, CheckpointStop
    from megatron_autohet.runtime.optimizer import make_lr_scheduler
    from megatron_autohet.runtime.trainer import HeteroTrainer, train_iterations

    trainer = HeteroTrainer(PLAN, PLAN.model, rank=rank, seed=SEED, optimizer=OPTIMIZER)
    scheduler = make_lr_scheduler(trainer.optimizer, OPTIMIZER, SCHEDULE_ITERS,
                                  PLAN.global_batch_size)
    checkpointer = Checkpointer(options, trainer, scheduler, seed=SEED, train_args={})
    if patch is not None:
        patch(rank, checkpointer)
    resumed, resume = [], checkpointer.resume

    def recording_resume():
        progress = resume()
        resumed.append(progress.iteration)
        return progress

    checkpointer.resume = recording_resume
    code = 0
    try:
        train_iterations(trainer, Batches(global_batches(PLAN, SCHEDULE_ITERS)), scheduler,
                         train_iters=total, scheduler_increment=PLAN.global_batch_size,
                         log=False, checkpointer=checkpointer)
    except CheckpointStop as stop:
        code = stop.code
    return {"code": code, "failed": checkpointer.failed_saves,
            "failed_uploads": checkpointer.failed_uploads,
            "skipped": checkpointer.skipped_saves, "resumed_from": resumed[0],
            "seen_uploads": getattr(checkpointer, "seen_uploads", None)}


@pytest.fixture
def small_disk(tmp_path):
    """A mount point for a tmpfs of a given size in KiB; unmounted after the test."""
    mounted = []

    def mount(kib: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs",
                                 str(where)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _console(capfd) -> str:
    out, err = capfd.readouterr()
    return out + err


def _no_traceback(console: str) -> None:
    assert "Traceback" not in console and "Exception in thread" not in console, console


def _partials(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]


def step_bytes(tmp_path_factory) -> int:
    """Bytes of one committed step of PLAN (measured once, on a real disk)."""
    root = tmp_path_factory.mktemp("size")
    run_on_ranks(PLAN.world_size, _job, CheckpointOptions(save=str(root), save_interval=2), 2)
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def one_step(tmp_path_factory) -> int:
    return step_bytes(tmp_path_factory)



def _lines(console: str, text: str) -> list[str]:
    return [line for line in console.splitlines() if text in line]


@pytest.mark.integration
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_full_disk_stops_the_job_after_consecutive_failed_saves(async_save, small_disk, one_step,
                                                                capfd):
    """No step fits: each save fails with "No space left on device" and its path, removes its
    partial directory; the second in a row (--autohet-max-failed-saves 2) stops every rank with
    status 1 and one ERROR line saying no step is complete."""
    disk = small_disk(one_step // 2 // 1024)
    options = CheckpointOptions(save=str(disk), save_interval=2, async_save=async_save)
    results = run_on_ranks(PLAN.world_size, _job, options, 8)
    console = _console(capfd)
    _no_traceback(console)
    assert [r["code"] for r in results] == [1, 1], console
    assert results[0]["failed"] == results[1]["failed"]
    assert len(results[0]["failed"]) == 2
    errors = _lines(console, "ERROR: checkpoint of iteration")
    assert len(errors) == 1, console
    assert "No space left on device" in errors[0] and str(disk) in errors[0], errors[0]
    assert "2 saves in a row failed (--autohet-max-failed-saves 2)" in errors[0], errors[0]
    assert f"No complete step in {disk}" in errors[0], errors[0]
    assert len(_lines(console, "WARNING: checkpoint of iteration")) == 1, console
    assert _partials(disk) == []
    assert committed_steps(disk) == []
    log = (disk / ERROR_LOG).read_text()
    assert "Traceback" in log and "SaveFailed" in log


def _disk_full_at_the_write_call(rank, checkpointer):
    """torch DCP's writer gets ENOSPC from its file write, as on a full disk."""
    import torch.distributed.checkpoint.filesystem as filesystem

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    filesystem._write_item = full


@pytest.mark.integration
def test_write_error_inside_dcp_is_reported_with_its_cause(tmp_path, capfd):
    """Where no tmpfs can be mounted too: a filesystem error raised inside DCP's writer on every
    rank reaches the line as itself (DCP carries it pickled in its CheckpointException), the
    partial steps go, and two in a row stop the job."""
    options = CheckpointOptions(save=str(tmp_path), save_interval=2)
    results = run_on_ranks(PLAN.world_size, _job, options, 6, patch=_disk_full_at_the_write_call)
    console = _console(capfd)
    _no_traceback(console)
    assert [r["code"] for r in results] == [1, 1] and results[0]["failed"] == [2, 4]
    errors = _lines(console, "ERROR: checkpoint of iteration 4 failed: writing iteration 4 to "
                             f"{tmp_path} failed: OSError: [Errno 28] No space left on device "
                             "(ranks 0-1)")
    assert len(errors) == 1, console
    assert _partials(tmp_path) == [] and committed_steps(tmp_path) == []


def _io_error_under_the_serializer(rank, checkpointer):
    """On rank 1 only, DCP's writer fails as torch's zip serializer does over a failing disk:
    its own RuntimeError raised while handling the OSError underneath."""
    import torch.distributed.checkpoint.filesystem as filesystem

    def failing(*args, **kwargs):
        try:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 704 vs 598")

    if rank == 1:
        filesystem._write_item = failing


@pytest.mark.integration
def test_write_error_names_the_failing_ranks_own_cause_not_the_serializers(tmp_path, capfd):
    """DCP hands every rank each failed rank's exception pickled, which drops its chain: the line
    must still name the OSError under the serializer's message (the failing rank raises DCP's
    exception from its own), on a disk that is not full."""
    options = CheckpointOptions(save=str(tmp_path), save_interval=2)
    results = run_on_ranks(PLAN.world_size, _job, options, 6,
                           patch=_io_error_under_the_serializer)
    console = _console(capfd)
    _no_traceback(console)
    assert [r["code"] for r in results] == [1, 1] and results[0]["failed"] == [2, 4]
    errors = _lines(console, "ERROR: checkpoint of iteration 4 failed: writing iteration 4 to "
                             f"{tmp_path} failed: OSError: [Errno 5] Input/output error "
                             "(rank 1)")
    assert len(errors) == 1, console
    assert "unexpected pos" not in errors[0]
    assert _partials(tmp_path) == [] and committed_steps(tmp_path) == []


@pytest.mark.integration
def test_last_save_failing_stops_the_job_saying_which_steps_are_complete(small_disk, one_step,
                                                                         capfd):
    """One step fits, two do not: step 2 commits, the run's last save (3) fails: status 1 (not
    the K-th failure in a row: --autohet-max-failed-saves 5)."""
    disk = small_disk(one_step * 3 // 2 // 1024)
    options = CheckpointOptions(save=str(disk), save_interval=2, max_failed_saves=5)
    results = run_on_ranks(PLAN.world_size, _job, options, 3)
    console = _console(capfd)
    _no_traceback(console)
    assert [r["code"] for r in results] == [1, 1], console
    assert results[0]["failed"] == [3]
    errors = _lines(console, "ERROR: checkpoint of iteration 3 failed")
    assert len(errors) == 1, console
    assert "No space left on device" in errors[0], errors[0]
    assert f"it was the last save of the run. Complete steps in {disk}: 2" in errors[0], errors[0]
    assert committed_steps(disk) == [2] and _partials(disk) == []


@pytest.mark.e2e
def test_failed_upload_is_a_warning_and_training_goes_on_but_the_last_one_ends_the_job(
        tmp_path, capfd, refused_url, s3_endpoint):
    """The S3 endpoint refuses every connection: each save's upload warns once with the reason,
    the local steps are complete and training goes on; the last save's upload failing ends the
    job with status 1 and one ERROR line (the durable copy asked for is not there). (s3_endpoint:
    for its dummy credentials.)"""
    options = CheckpointOptions(save=str(tmp_path), save_interval=2,
                                s3_uri="s3://autohet-test/run", s3_endpoint_url=refused_url)
    results = run_on_ranks(PLAN.world_size, _job, options, 4)
    console = _console(capfd)
    _no_traceback(console)
    assert [r["code"] for r in results] == [1, 1]
    assert results[0]["failed"] == [] and results[0]["failed_uploads"] == [2, 4]
    warnings = _lines(console, "WARNING: uploading iteration")
    assert len(warnings) == 2, console
    assert all("ConnectionRefusedError" in w and "the local checkpoint of iteration" in w
               for w in warnings), warnings
    errors = _lines(console, "ERROR:")
    assert len(errors) == 1, console
    assert ("ERROR: the last checkpoint (iteration 4) did not reach s3://autohet-test/run: "
            in errors[0] and f"Complete steps in {tmp_path}: 2, 4" in errors[0]), errors[0]
    assert committed_steps(tmp_path) == [2, 4]


@pytest.mark.integration
def test_an_s3_bucket_that_does_not_exist_is_refused_before_training(s3_endpoint, tmp_path,
                                                                     capfd):
    endpoint, _ = s3_endpoint
    options = CheckpointOptions(save=str(tmp_path), save_interval=2,
                                s3_uri="s3://autohet-no-such-bucket/run",
                                s3_endpoint_url=endpoint)
    with pytest.raises(RankFailed, match="s3://autohet-no-such-bucket/run cannot be used: .*"
                       "NoSuchBucket"):
        run_on_ranks(PLAN.world_size, _job, options, 4)
    assert committed_steps(tmp_path) == []


def _kill_while_committing(iteration):
    """Rank 0 (the directory's leader) dies by SIGKILL between writing step ``iteration``'s
    manifest and committing it."""
    def patch(rank, checkpointer):
        import megatron_autohet.checkpoint.writer as writer

        commit = writer.commit_step_dir

        def killed(root, it):
            if it == iteration:
                os.kill(os.getpid(), signal.SIGKILL)
            return commit(root, it)

        writer.commit_step_dir = killed
    return patch


@pytest.mark.integration
def test_save_killed_in_the_middle_leaves_the_previous_step_to_resume(tmp_path):
    """A rank killed while its step is written leaves no committed step but an
    ``iter_N.partial``: the next job resumes the previous step, and its first commit removes the
    partial directory."""
    with pytest.raises(RankFailed, match="rank 0 of 2:\ndied with exit code -9"):
        run_on_ranks(PLAN.world_size, _job,
                     CheckpointOptions(save=str(tmp_path), save_interval=2), 4,
                     patch=_kill_while_committing(4), timeout=300)
    assert committed_steps(tmp_path) == [2]
    assert _partials(tmp_path) == ["iter_0000004" + PARTIAL_SUFFIX]
    # Another interval: no save of this run writes iteration 4 again, yet its partial goes.
    options = CheckpointOptions(save=str(tmp_path), save_interval=3, load=str(tmp_path))
    results = run_on_ranks(PLAN.world_size, _job, options, 6)
    assert [r["resumed_from"] for r in results] == [2, 2]
    assert committed_steps(tmp_path) == [3, 6] and _partials(tmp_path) == []


def _hold_writer_of_rank_1(until_after: int):
    """Rank 1's background save of iteration 2 stays alive (its step written) until the training
    thread is past iteration ``until_after``: rank 0's is long done by then."""
    def patch(rank, checkpointer):
        release = threading.Event()
        write_step, after_iteration = checkpointer._write_step, checkpointer.after_iteration

        def held(state_dict, common, iteration, times, root):
            write_step(state_dict, common, iteration, times, root)
            if rank == 1 and iteration == 2:
                release.wait()

        def after(iteration):
            after_iteration(iteration)
            if iteration == until_after:
                release.set()

        checkpointer._write_step, checkpointer.after_iteration = held, after
    return patch


@pytest.mark.integration
def test_async_save_still_writing_at_the_next_interval_is_skipped_on_every_rank(tmp_path,
                                                                                capfd):
    """Training does not wait for a save still being written: the interval's save is skipped on
    every rank (one line), although only rank 1's writer is still busy; the last save of the run
    is made."""
    options = CheckpointOptions(save=str(tmp_path), save_interval=2, async_save=True)
    results = run_on_ranks(PLAN.world_size, _job, options, 6, patch=_hold_writer_of_rank_1(4))
    console = _console(capfd)
    _no_traceback(console)
    assert [r["skipped"] for r in results] == [[4], [4]]
    assert [r["code"] for r in results] == [0, 0] and results[0]["failed"] == []
    assert len(_lines(console, "skipping the checkpoint of iteration 4: the one of iteration 2 "
                               "is still being written")) == 1, console
    assert committed_steps(tmp_path) == [2, 6]


ROOT = Path(__file__).resolve().parents[2]


def _autohet_train(tmp_path: Path, *flags) -> subprocess.CompletedProcess:
    """``autohet train`` of PLAN for 6 iterations, through torchrun's agent as a user runs it."""
    plan = tmp_path / "two-ranks.yaml"
    PLAN.save(plan)
    return subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan",
                           str(plan), "--model", str(ROOT / "configs" / "models" / "tiny.yaml"),
                           "--iters", "6", *map(str, flags)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.e2e
def test_autohet_train_on_a_full_disk_exits_1_with_one_line(small_disk, one_step, tmp_path):
    """The whole command, background saves: the job's console has the one ERROR line (stderr),
    no traceback (the writer thread's, the ranks', the launcher's), and status 1."""
    disk = small_disk(one_step // 2 // 1024)
    result = _autohet_train(tmp_path, "--save", disk, "--save-interval", 2, "--async-save")
    console = result.stdout + result.stderr
    _no_traceback(console)
    assert result.returncode == 1, console[-3000:]
    errors = _lines(result.stderr, "ERROR: checkpoint of iteration 4 failed")
    assert len(errors) == 1 and "No space left on device" in errors[0], console[-3000:]
    assert _partials(disk) == []


@pytest.mark.e2e
def test_exit_on_missing_checkpoint_is_one_line_and_status_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _autohet_train(tmp_path, "--load", empty, "--exit-on-missing-checkpoint")
    _no_traceback(result.stdout + result.stderr)
    assert result.returncode == 2, result.stderr[-3000:]
    line = (f"autohet train: error: <command line>: field '--load': no complete checkpoint in "
            f"{empty} (allowed: a directory holding one, as --exit-on-missing-checkpoint is "
            "set)\n")
    assert result.stderr.count(line) == 1, result.stderr[-3000:]
    assert "iteration        1/" not in result.stdout          # nothing trained


@pytest.mark.unit
def test_root_cause_is_the_innermost_exception_and_dcp_failures_are_deduplicated():
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_autohet.checkpoint.failures import root_cause
    from megatron_autohet.checkpoint.writer import SaveFailed

    def chained():
        try:
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                raise RuntimeError("unexpected pos 704 vs 598")
        except RuntimeError as err:
            return err

    assert root_cause(chained()) == "OSError: [Errno 28] No space left on device"
    try:
        try:
            raise KeyError("internal")
        except KeyError:
            raise ValueError("bad manifest") from None     # the context is suppressed
    except ValueError as err:
        assert root_cause(err) == "ValueError: bad manifest"
    disk_full = OSError(28, "No space left on device")
    dcp = CheckpointException("write", {0: (disk_full, []), 1: (OSError(28, "No space left on "
                                                                      "device"), []),
                                        3: (RuntimeError("boom\nsecond line"), [])})
    assert root_cause(dcp) == ("OSError: [Errno 28] No space left on device; "
                               "RuntimeError: boom")
    assert str(SaveFailed("writing iteration 4 to /ckpt", {"OSError: full": [0, 1, 2],
                                                           "KeyError: 'x'": [1, 3]})) == (
        "writing iteration 4 to /ckpt failed: OSError: full (ranks 0-2); KeyError: 'x' "
        "(ranks 1, 3)")


def _upload_waits_for_the_next_iteration(rank, checkpointer):
    """Each upload but the last save's waits until training has finished the iteration after
    its save: it can only get there if training does not wait for the upload. Records where
    each upload ran and whether training got past it."""
    import threading

    import megatron_autohet.checkpoint.checkpointer as hook

    upload, seen, trained = hook.upload_step, [], {}
    original_after = checkpointer.after_iteration

    def after_iteration(iteration):
        trained.setdefault(iteration, threading.Event()).set()
        original_after(iteration)

    def upload_step(store, manifest, *args, **kwargs):
        ran_on = threading.current_thread().name
        went_on = (trained.setdefault(manifest.iteration + 1, threading.Event()).wait(60)
                   if manifest.iteration < LAST else None)
        seen.append((manifest.iteration, ran_on, went_on))
        return upload(store, manifest, *args, **kwargs)
    hook.upload_step = upload_step
    checkpointer.after_iteration = after_iteration
    checkpointer.seen_uploads = seen


LAST = 3


@pytest.mark.integration
def test_a_synchronous_save_uploads_in_the_background(s3_endpoint, s3_uri, tmp_path):
    """Without --async-save the step is written and committed on the training thread, and its
    upload runs beside training: training finishes the next iteration while the upload waits
    (the last save's upload is waited for at the end: there is no next iteration)."""
    options = CheckpointOptions(save=str(tmp_path), save_interval=2, s3_uri=s3_uri,
                                s3_endpoint_url=s3_endpoint[0])
    results = run_on_ranks(PLAN.world_size, _job, options, LAST,
                           patch=_upload_waits_for_the_next_iteration)
    assert [r["code"] for r in results] == [0, 0]
    assert results[0]["failed_uploads"] == []
    assert [r["seen_uploads"] for r in results] == [
        [(2, "autohet-upload-2", True), (3, "autohet-upload-3", None)]] * 2
    assert committed_steps(tmp_path) == [2, 3]
