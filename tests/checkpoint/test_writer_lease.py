"""One live writer per checkpoint location, and no committed step ever replaced, through the real
front end and the real training hook: a second job on a live job's directory or S3 prefix is
refused in one line before its ranks start, naming the owner; `--autohet-take-over-ckpt` takes
the lease from an owner known dead, and the job it was taken from stops saving at once; a run
that would save over committed steps it did not resume from is refused (no --load) or sets them
aside (resumed from an older step), and the steps it did not write stay byte-identical."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.checkpoint.lease import LEASE_FILE, DirectorySlot, Lease, ObjectStoreSlot
from megatron_autohet.checkpoint.manifest import committed_steps
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.checkpoint.s3_store import S3Store

from helpers.checkpointing import train_job
from helpers.dist_utils import RankFailed, run_on_ranks
from helpers.training import global_batches, plan

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"


def autohet_train(tmp_path, *flags, iters=4) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan", str(PLAN),
         "--model", str(MODEL), "--iters", str(iters), "--data-dir", str(tmp_path / "data"),
         *map(str, flags)], capture_output=True, text=True, cwd=ROOT, timeout=600)


def tree_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.integration
def test_a_second_writer_is_refused_in_one_line_before_any_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    live = Lease([DirectorySlot(ckpt)], "the first job")        # alive: this test's process
    live.take()
    result = autohet_train(tmp_path, "--save", ckpt, "--save-interval", 2)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("autohet train: error: <command line>: field '--save': ")
    assert "being written by a live job: the first job (host " in lines[0]
    assert "--autohet-take-over-ckpt if it is known to be dead" in lines[0]
    assert " iteration " not in result.stdout and not committed_steps(ckpt)   # nothing trained
    assert DirectorySlot(ckpt).read()[0].owner == "the first job"


@pytest.mark.integration
def test_a_live_owner_of_the_s3_prefix_refuses_the_job(tmp_path, s3_endpoint, s3_uri):
    store = S3Store(s3_uri, endpoint_url=s3_endpoint[0])
    Lease([ObjectStoreSlot(store)], "the first job").take()
    result = autohet_train(tmp_path, "--autohet-local-ckpt-dir", tmp_path / "local-{node}",
                           "--save-interval", 2, "--autohet-s3-uri", s3_uri,
                           "--autohet-s3-endpoint-url", s3_endpoint[0])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "field '--autohet-s3-uri': " + s3_uri in result.stderr
    assert "the first job" in result.stderr
    # all or nothing: the node directories it had leased are given back
    assert not list(tmp_path.glob(f"local-*/{LEASE_FILE}"))


@pytest.mark.integration
def test_a_bucket_that_does_not_exist_is_refused_before_training(tmp_path, s3_endpoint):
    result = autohet_train(tmp_path, "--save", tmp_path / "ckpt", "--save-interval", 2,
                           "--autohet-s3-uri", "s3://no-such-bucket-here/p",
                           "--autohet-s3-endpoint-url", s3_endpoint[0])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "autohet train: error: <command line>: field '--autohet-s3-uri': "
        "s3://no-such-bucket-here/p cannot be used: "
        + result.stderr.split("cannot be used: ", 1)[1].strip()]
    assert "NoSuchBucket" in result.stderr and " iteration " not in result.stdout


@pytest.mark.e2e
def test_take_over_trains_and_the_job_taken_from_commits_nothing_more(tmp_path):
    ckpt = tmp_path / "ckpt"
    old = Lease([DirectorySlot(ckpt)], "a job known dead")
    old.take()
    result = autohet_train(tmp_path, "--save", ckpt, "--save-interval", 2,
                           "--autohet-take-over-ckpt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert committed_steps(ckpt) == [2, 4]
    assert not (ckpt / LEASE_FILE).exists()              # released at the end


def _taken_over_after_first_save(rank, world, the_plan, batches, ckpt):
    """The job saves at 2; right after, another job takes its lease over: the save at 4 must not
    commit, and the job stops at once (whatever --autohet-max-failed-saves says)."""
    from megatron_autohet.checkpoint import checkpointer as hook

    original = hook.Checkpointer.after_iteration

    def after_iteration(self, iteration):
        original(self, iteration)
        if iteration == 2 and rank == 0:
            Lease([DirectorySlot(ckpt)], "the new owner").take(take_over=True)
    hook.Checkpointer.after_iteration = after_iteration
    options = CheckpointOptions(save=str(ckpt), save_interval=2, max_failed_saves=5)
    return train_job(rank, world, the_plan, batches, options, total=6)


@pytest.mark.integration
def test_a_job_whose_lease_was_taken_over_stops_without_committing(tmp_path, capfd):
    the_plan = plan("tiny-two-pipelines")
    batches = global_batches(the_plan, 6)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RankFailed, match="CheckpointStop"):
        run_on_ranks(the_plan.world_size, _taken_over_after_first_save, the_plan, batches, ckpt)
    errors = [line for line in capfd.readouterr().err.splitlines() if "ERROR:" in line]
    assert len(errors) == 1, errors
    assert "checkpoint of iteration 4 failed: " in errors[0]
    assert "the checkpoint lease of " in errors[0] and "the new owner" in errors[0]
    assert "the job stops: another job took over its checkpoint lease" in errors[0]
    assert committed_steps(ckpt) == [2]
    assert DirectorySlot(ckpt).read()[0].owner == "the new owner"


@pytest.mark.e2e
def test_committed_steps_are_never_replaced_by_a_later_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = autohet_train(tmp_path, "--save", ckpt, "--save-interval", 2, iters=6)
    assert first.returncode == 0, first.stderr[-3000:]
    assert committed_steps(ckpt) == [2, 4, 6] or committed_steps(ckpt) == [4, 6]
    before = tree_digest(ckpt / "iter_0000006")
    # the same command again, --load forgotten: refused, nothing written
    again = autohet_train(tmp_path, "--save", ckpt, "--save-interval", 2, iters=6)
    assert again.returncode == 2, again.stderr[-3000:]
    errors = [line for line in again.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, again.stderr[-3000:]             # printed once, by rank 0
    assert "committed checkpoint steps are there" in errors[0]
    assert "this run trains from scratch (no --load)" in again.stderr
    # back in time on purpose: the newer step is set aside, byte-identical, never replaced
    back = autohet_train(tmp_path, "--save", ckpt, "--load", ckpt, "--ckpt-step", 4,
                         "--save-interval", 2, "--autohet-keep-ckpts", 5, iters=6)
    assert back.returncode == 0, back.stderr[-3000:]
    assert "set aside as iter_N.set-aside-" in back.stdout
    aside = list(ckpt.glob("iter_0000006.set-aside-*"))
    assert len(aside) == 1 and tree_digest(aside[0]) == before
    assert 6 in committed_steps(ckpt)                   # this run's own step 6


@pytest.mark.unit
def test_a_commit_never_renames_over_a_committed_step(tmp_path):
    from megatron_autohet.checkpoint.manifest import commit_step_dir, partial_dir

    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "theirs").write_text("a committed step of another writer")
    partial_dir(tmp_path, 2).mkdir()
    (partial_dir(tmp_path, 2) / "mine").write_text("this save")
    with pytest.raises(FileExistsError, match="a committed step is never replaced"):
        commit_step_dir(tmp_path, 2)
    assert (tmp_path / "iter_0000002" / "theirs").read_text() == (
        "a committed step of another writer")
