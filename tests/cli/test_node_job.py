"""`autohet node -- <train args>` checks the training arguments once, on the node, before any
worker starts, and hands its workers their options as data (a job file, cli/train.py
``node_job``), as `autohet train`'s launcher does for its ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_autohet.cli.main import build_parser, main
from megatron_autohet.cli.train import node_job, train_options
from megatron_autohet.job import ElasticOptions, TrainOptions

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SPOT = ROOT / "configs/clusters/spot-4.yaml"
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"
NODE = ["node", "--rendezvous", "127.0.0.1:1", "--job-id", "j", "--nnodes", "1:2"]


def _train_args(tmp_path) -> list[str]:
    """An elastic job's `autohet train` arguments, as the emulated fleet passes them."""
    return ["--plan", str(PLAN), "--model", str(MODEL), "--cluster", str(SPOT), "--iters", "12",
            "--save-interval", "4", "--lr", "3e-4",
            "--autohet-local-ckpt-dir", str(tmp_path / "{node}" / "ckpt"),
            "--autohet-notice-file", str(tmp_path / "{node}" / "notice.json"),
            "--autohet-events-jsonl", str(tmp_path / "events.jsonl")]


def test_the_workers_get_the_checked_options_as_a_job_file(tmp_path):
    job = node_job(["--", *_train_args(tmp_path)])
    # the options `autohet train --elastic` builds from the same flags (--elastic implied)
    flags = build_parser().parse_args(["train", *_train_args(tmp_path), "--elastic"])
    assert job.options == train_options(flags)
    assert job.options.elastic == ElasticOptions(
        cluster=str(SPOT), notice_file=str(tmp_path / "{node}" / "notice.json"),
        events_jsonl=str(tmp_path / "events.jsonl"))
    assert job.options.checkpoint.load == str(tmp_path / "{node}" / "ckpt")   # resumes locally
    worker_args = job.write(tmp_path)
    job_file = str(tmp_path / "options.json")
    assert worker_args == ["train", "--plan", str(PLAN), "--model", str(MODEL),
                           "--job-file", job_file]
    assert TrainOptions.read(job_file) == job.options


@pytest.mark.parametrize("train_args,message", [
    (["--iters", "0"], "field '--iters': got 0"),
    (["--bogus", "1"], "field '--bogus': not a flag of autohet train"),
    (["--num-layers", "4"], "field '--num-layers': a Megatron-LM flag autohet train does not "
                            "take (allowed: the model file's num_layers)"),
    (["--lr-decay-style", "steps"], "argument --lr-decay-style: invalid choice: 'steps'"),
    (["--ckpt-step", "4"], "field '--ckpt-step': given with --elastic"),
    (["--job-file", "x.json"], "field '--job-file': given after --"),
])
def test_bad_training_arguments_end_the_node_with_one_line(train_args, message, tmp_path,
                                                           capsys):
    """Before any agent, fork server or worker: one line naming the flag, status 2."""
    assert main([*NODE, "--", *_train_args(tmp_path), *train_args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autohet node: error: <command line>: ")
    assert message in err[0]


@pytest.mark.parametrize("node_args,message", [
    (["--signal-grace", "10"], "field '--signal-grace': given without --notice-file"),
    (["--notice-file", "n.json", "--signal-grace", "0"], "field '--signal-grace': got 0"),
    (["--loss-timeout", "3"], "field '--loss-timeout': got 3 (allowed: seconds >= 4"),
    (["--loss-timeout", "0"], "field '--loss-timeout': got 0.0 (allowed: a number > 0)"),
    (["--loss-timeout", "inf"], "field '--loss-timeout': got inf, not a finite number"),
])
def test_bad_node_arguments_are_one_line(node_args, message, tmp_path, capsys):
    """--signal-grace says when SIGTERM's notice is due: refused where no notice is written;
    --loss-timeout below two keep-alive intervals (and the confirmation) would declare live
    nodes lost."""
    assert main([*NODE, *node_args, "--", *_train_args(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_missing_training_arguments_are_one_line(tmp_path, capsys):
    assert main([*NODE, "--"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "autohet node: error: <command line>: field '--': no training arguments (allowed: -- "
        "followed by `autohet train` arguments (--plan, --model, ...))"]
    args = _train_args(tmp_path)
    without_cluster = args[:4] + args[6:]
    assert main([*NODE, "--", *without_cluster]) == 2
    assert "field '--cluster': missing with --elastic" in capsys.readouterr().err
    assert main([*NODE, "--", *args[:4], "--cluster", str(tmp_path / "none.yaml"),
                 *args[6:]]) == 2
    assert "none.yaml: field '<file>': file not found" in capsys.readouterr().err
