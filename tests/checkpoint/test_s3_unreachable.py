"""A resume whose S3 tier cannot be reached, and saves over a step S3 already holds.

The listing is tried again for a stated time (sources.reach_delays), then the job stops with one
line, status 2, unless --autohet-resume-without-s3 says to go on from the disks alone; a job that
did so never replaces the files of a step committed in S3 (checkpoint/upload.py)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.checkpoint.inspect import verify_s3
from megatron_autohet.checkpoint.manifest import MANIFEST_FILE, committed_steps, step_dir_name
from megatron_autohet.checkpoint.options import CheckpointOptions, tier_fields, tier_flags
from megatron_autohet.checkpoint.sources import (S3_REACH_ENV, StoreError, StoreReader,
                                                 reach_delays)
from megatron_autohet.errors import ConfigError, JobConfigError
from helpers.checkpointing import HALF, train_job
from helpers.dist_utils import run_on_ranks
from helpers.training import global_batches, plan

A = "tiny-two-pipelines"
ROOT = Path(__file__).resolve().parents[2]
FLAG = "--autohet-resume-without-s3"


class _Location:
    def uri(self, relative: str = "") -> str:
        return "s3://autohet-test/down" + (f"/{relative}" if relative else "")


class _DownStore:
    """A store whose listing fails (the first ``failing`` times; None: always), counting the
    attempts."""

    location = _Location()

    def __init__(self, failing: int | None = None):
        self.failing = failing
        self.attempts = 0

    def steps_holding(self, name: str) -> list[int]:
        self.attempts += 1
        if self.failing is None or self.attempts <= self.failing:
            raise StoreError("S3 list s3://autohet-test/down failed: connection refused")
        return [4]


@pytest.mark.integration
def test_a_bucket_that_does_not_exist_is_not_waited_for(s3_endpoint):
    """No such bucket is no outage: the listing's answer comes at once, with no attempt more."""
    from megatron_autohet.checkpoint.s3_store import S3Store

    store = S3Store("s3://autohet-no-such-bucket/p", endpoint_url=s3_endpoint[0])
    lines, slept = [], []
    why = StoreReader(store).committed_steps(lines.append, sleep=slept.append)
    assert "NoSuchBucket" in why and slept == [] and lines == []
    assert why.startswith("not tried again, as waiting cannot mend it: ")


@pytest.mark.unit
def test_the_listing_is_tried_again_within_the_stated_limit(monkeypatch):
    """Counted in attempts, not seconds (the waits are recorded, not slept): 1 + 7 over the
    default 60 s, 3 over a limit of 3 s, 1 for 0; a store back during the waits answers; the
    failure is said once."""
    monkeypatch.delenv(S3_REACH_ENV, raising=False)
    assert reach_delays() == [1, 2, 4, 8, 15, 15, 15] and sum(reach_delays()) == 60
    for limit, attempts, waits in ((None, 8, [1, 2, 4, 8, 15, 15, 15]), ("3", 3, [1, 2]),
                                   ("0", 1, [])):
        if limit is not None:
            monkeypatch.setenv(S3_REACH_ENV, limit)
        store, lines, slept = _DownStore(), [], []
        why = StoreReader(store).committed_steps(lines.append, sleep=slept.append)
        assert why == (f"tried for {sum(waits):g} s: S3 list s3://autohet-test/down failed: "
                       "connection refused")
        assert store.attempts == attempts and slept == waits
        assert len(lines) == (1 if waits else 0)
    monkeypatch.delenv(S3_REACH_ENV)
    store, lines = _DownStore(failing=2), []
    assert StoreReader(store).committed_steps(lines.append, sleep=lambda s: None) == {4}
    assert store.attempts == 3
    assert lines == ["WARNING: the S3 tier s3://autohet-test/down is unreachable (S3 list "
                     "s3://autohet-test/down failed: connection refused); trying again for up "
                     "to 60 s (7 more attempts)"]


@pytest.mark.unit
def test_the_flag_is_read_by_tier_flags_and_refused_where_it_means_nothing():
    parser = argparse.ArgumentParser()
    for flags, kwargs in tier_flags():
        parser.add_argument(*flags, **kwargs)
    assert tier_fields(parser.parse_args([FLAG]))["resume_without_s3"] is True
    assert tier_fields(parser.parse_args([]))["resume_without_s3"] is False
    for options, missing in ((CheckpointOptions(load="ckpt", resume_without_s3=True),
                              "--autohet-s3-uri"),
                             (CheckpointOptions(save="ckpt", save_interval=2, s3_uri="s3://autohet-test/p",
                                                resume_without_s3=True), "--load")):
        with pytest.raises(ConfigError, match=f"field '{FLAG}': given without {missing}"):
            options.validate()
    CheckpointOptions(load="ckpt", s3_uri="s3://autohet-test/p", resume_without_s3=True).validate()


def _step_in_s3_only(tmp_path, s3_uri, endpoint, batches) -> str:
    """Save iteration HALF with the local tier and S3, then lose every node's disk."""
    local = str(tmp_path / "local" / "{node}")
    options = CheckpointOptions(local_dir=local, save_interval=HALF, s3_uri=s3_uri,
                                s3_endpoint_url=endpoint)
    run_on_ranks(4, train_job, plan(A), batches, options, exit_interval=HALF)
    shutil.rmtree(tmp_path / "local")
    return local


def _s3_step_verifies(s3_uri, endpoint) -> None:
    from megatron_autohet.checkpoint.s3_store import S3Store

    report = verify_s3(S3Store(s3_uri, endpoint_url=endpoint), HALF)
    assert report.ok and report.items_checked > 0, report.problems


@pytest.mark.e2e
def test_s3_down_at_load_stops_the_job_in_one_line(tmp_path, s3_endpoint, s3_uri, refused_url):
    """The issue's case: the step is in S3 alone and the endpoint is down at --load. `autohet
    train` stops before training with one line naming the S3 URI and the flag, status 2 (as a
    resume no step can serve: the job's JobConfigError), after the stated attempts; S3's step is
    untouched. (The code before this change trained from scratch, status 0.)"""
    endpoint, _ = s3_endpoint
    batches = global_batches(plan(A), 2 * HALF)
    local = _step_in_s3_only(tmp_path, s3_uri, endpoint, batches)
    metrics = tmp_path / "metrics.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan",
         str(ROOT / "configs/plans/tiny-two-pipelines.yaml"), "--model",
         str(ROOT / "configs/models/tiny.yaml"), "--iters", str(2 * HALF), "--load", local,
         "--autohet-local-ckpt-dir", local, "--save-interval", str(HALF), "--autohet-s3-uri",
         s3_uri, "--autohet-s3-endpoint-url", refused_url, "--metrics-jsonl", str(metrics),
         "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env=dict(os.environ, **{S3_REACH_ENV: "1"}))
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    assert re.search(rf"field '--autohet-s3-uri': {re.escape(s3_uri)} cannot be reached at "
                     r"--load \(tried for 1 s: .*\).* could overwrite the steps it holds "
                     rf"\(allowed: make the S3 tier reachable .*{FLAG} to recover from the "
                     "disks alone", errors[0]), errors[0]
    # one warning of the first failure (rank 0's), 2 attempts in all; nothing trained or saved
    assert (result.stdout.count(f"WARNING: the S3 tier {s3_uri} is unreachable")) == 1
    assert "(1 more attempts)" in result.stdout
    assert not metrics.exists() or not metrics.read_text().strip()
    assert not any(committed_steps(d) for d in (tmp_path / "local").glob("*"))
    _s3_step_verifies(s3_uri, endpoint)


def _job_listing_s3_as_down(rank, world, the_plan, batches, options):
    """A job whose resume finds S3 unreachable (its listing fails every attempt) while every
    other request reaches it: the saves after such a resume meet S3's committed steps."""
    from megatron_autohet.checkpoint import sources

    sources.StoreReader.committed_steps = lambda self, log, **_: "S3 list failed: refused"
    try:
        return train_job(rank, world, the_plan, batches, options)
    except JobConfigError as err:
        return str(err)


@pytest.mark.e2e
def test_with_the_flag_the_job_trains_and_keeps_s3s_committed_step(tmp_path, s3_endpoint,
                                                                    s3_uri, capfd):
    """Without the flag every rank raises the same JobConfigError; with it the job trains from
    scratch as before (no disk holds a step) - and its save of iteration HALF, which S3 holds
    committed from the first run, uploads nothing: one WARNING, S3's step still verifies (the
    code before this change replaced its data files: a checksum mismatch)."""
    endpoint, _ = s3_endpoint
    batches = global_batches(plan(A), 2 * HALF)
    local = _step_in_s3_only(tmp_path, s3_uri, endpoint, batches)
    capfd.readouterr()
    options = CheckpointOptions(load=local, local_dir=local, save_interval=HALF, s3_uri=s3_uri,
                                s3_endpoint_url=endpoint)
    stopped = run_on_ranks(4, _job_listing_s3_as_down, plan(A), batches, options)
    assert len(set(stopped)) == 1 and isinstance(stopped[0], str)
    assert f"{s3_uri} cannot be reached at --load" in stopped[0] and FLAG in stopped[0]
    assert not any(committed_steps(d) for d in (tmp_path / "local").glob("*"))

    options = CheckpointOptions(load=local, local_dir=local, save_interval=HALF, s3_uri=s3_uri,
                                s3_endpoint_url=endpoint, resume_without_s3=True)
    metrics = run_on_ranks(4, _job_listing_s3_as_down, plan(A), batches, options)[0]
    assert isinstance(metrics, list) and len(metrics) == 2 * HALF      # from scratch
    out = capfd.readouterr().out
    assert out.count(f"WARNING: the S3 tier {s3_uri} is unreachable") == 1
    assert "no complete checkpoint in" in out and "training from scratch" in out
    _s3_step_verifies(s3_uri, endpoint)
    taken = f"{s3_uri}/{step_dir_name(HALF)}/{MANIFEST_FILE}"
    assert out.count(f"WARNING: iteration {HALF} is not uploaded to {s3_uri}: another save "
                     f"committed it there already ({taken})") == 1
    assert f"uploaded iteration {2 * HALF} to {s3_uri}" in out     # a new step goes up
