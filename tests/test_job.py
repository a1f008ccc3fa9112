"""job.py: a training job's options, validated in one place for both front ends (each bad value
names the flag as that front end spells it) and handed to the ranks as data."""

from dataclasses import replace
from pathlib import Path

import pytest

from helpers.cli import expect_usage_error
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.errors import ConfigError
from megatron_autohet.job import TrainOptions
from megatron_autohet.megatron.hooks import MEGATRON_FLAGS
from megatron_autohet.runtime.optimizer import OptimizerSettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"
OPTIONS = TrainOptions(iters=4, seed=7, optimizer=OptimizerSettings(lr=1e-3))


@pytest.mark.parametrize("field,value,flag,megatron_flag", [
    ("iters", 0, "--iters", "--train-iters"),
    ("eval_iters", 0, "--eval-iters", "--eval-iters"),
    ("exit_interval", -2, "--exit-interval", "--exit-interval"),
    ("log_interval", 0, "--log-interval", "--log-interval"),
    ("distributed_timeout_minutes", 0.0, "--distributed-timeout-minutes",
     "--distributed-timeout-minutes"),
    ("metrics_jsonl", "/no/such/dir/m.jsonl", "--metrics-jsonl", "--autohet-metrics-jsonl"),
    ("hidden_dropout", 1.0, "--hidden-dropout", "--hidden-dropout"),
])
def test_a_bad_value_names_the_flag_of_either_front_end(field, value, flag, megatron_flag):
    bad = replace(OPTIONS, **{field: value})
    with pytest.raises(ConfigError) as autohet_train:
        bad.validate()
    with pytest.raises(ConfigError) as pretrain_gpt:
        bad.validate("plan.yaml", MEGATRON_FLAGS)
    assert (autohet_train.value.field, pretrain_gpt.value.field) == (flag, megatron_flag)
    assert autohet_train.value.problem == pretrain_gpt.value.problem


def test_the_options_dataclasses_are_validated_with_the_job():
    """The optimizer's and the checkpoints' own checks, and the resume flags across the two."""
    with pytest.raises(ConfigError, match="field '--finetune': given without --load"):
        replace(OPTIONS, checkpoint=CheckpointOptions(finetune=True)).validate()
    with pytest.raises(ConfigError, match="field '--min-lr'"):
        replace(OPTIONS, optimizer=OptimizerSettings(lr=1e-3, min_lr=1.0)).validate()
    with pytest.raises(ConfigError, match="field '--use-checkpoint-opt-param-scheduler': given "
                                          "with --finetune"):
        replace(OPTIONS, optimizer=OptimizerSettings(lr=1e-3,
                                                     use_checkpoint_opt_param_scheduler=True),
                checkpoint=CheckpointOptions(load="ckpt", finetune=True)).validate("plan.yaml")
    assert OPTIONS.validate() is OPTIONS


def test_options_reach_the_ranks_as_data(tmp_path):
    """What the launcher writes is what every rank reads: nested dataclasses, not dicts."""
    options = replace(OPTIONS, metrics_jsonl="m.jsonl", eval_interval=2, precision="bf16",
                      optimizer=OptimizerSettings(lr=2e-3, min_lr=2e-4, lr_decay_style="cosine",
                                                  override_opt_param_scheduler=True),
                      checkpoint=CheckpointOptions(save="ckpt", save_interval=2, load="ckpt",
                                                   async_save=True, keep=3),
                      distributed_timeout_minutes=2.5, hidden_dropout=0.1)
    options.write(tmp_path / "options.json")
    read = TrainOptions.read(tmp_path / "options.json")
    assert read == options
    assert read.timeout == options.timeout and read.checkpoint.saving


def test_a_launched_rank_takes_its_options_from_the_job_file_only(tmp_path, capsys):
    OPTIONS.write(tmp_path / "options.json")
    job = ["train", "--plan", PLAN, "--model", MODEL, "--job-file", tmp_path / "options.json"]
    expect_usage_error(capsys, [*job, "--iters", "3"],
                       "autohet train: error: <command line>: field '--iters': given with "
                       "--job-file (allowed: only --plan and --model: a launched rank's "
                       "options are the job file's)")
    expect_usage_error(capsys, [*job, "--bf16"],
                       "autohet train: error: <command line>: field '--bf16': given with "
                       "--job-file (allowed: only --plan and --model: a launched rank's "
                       "options are the job file's)")


def test_a_job_file_outside_a_rank_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    OPTIONS.write(tmp_path / "options.json")
    expect_usage_error(capsys, ["train", "--plan", PLAN, "--model", MODEL,
                                "--job-file", tmp_path / "options.json"],
                       "autohet train: error: <command line>: field '--job-file': not in a rank "
                       "of a job (allowed: only in the ranks `autohet train` and `autohet "
                       "node` start)")


def test_a_plan_whose_recorded_profile_does_not_load_stops_the_job_once():
    """Every rank checks the plan's recorded profile before any collective (job.train_job): a
    hand-edited one that does not load is a JobConfigError on all of them, which the front ends
    print once (exit status 2), not rank 0 dying in its start-up log while the others wait."""
    from megatron_autohet.errors import JobConfigError
    from megatron_autohet.job import train_job
    from megatron_autohet.launch import load_job

    plan, model = load_job(PLAN, MODEL)
    plan.profile = {"model": "tiny", "fusions": {"bias_dropout_fusion": "yes"}, "entries": []}
    with pytest.raises(JobConfigError) as info:
        train_job(plan, "plan.yaml", model, OPTIONS, rank=1, local_rank=1)
    assert str(info.value) == (
        "plan.yaml: field 'profile.fusions': got {'bias_dropout_fusion': 'yes'} (allowed: a "
        "mapping of TransformerConfig fusion fields to true/false)")
