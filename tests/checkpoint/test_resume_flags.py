"""What a resume takes from a step: Megatron-LM's --override-opt-param-scheduler,
--use-checkpoint-opt-param-scheduler, --ckpt-step, --no-load-optim, --no-load-rng, --finetune.

One uninterrupted run of tiny-two-pipelines saves every ``INTERVAL`` iterations (steps 2, 4, 6,
8); every resume below loads from a copy of that directory, into the same plan or another one.
The expected learning rates come from a fresh megatron-core ``OptimizerParamScheduler`` built
here from hand-written sample counts, not from runtime/optimizer.py.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from megatron_autohet.checkpoint.manifest import step_dir_name
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.errors import ConfigError
from helpers.dist_utils import run_on_ranks
from helpers.checkpointing import TOTAL, Batches
from helpers.cli import expect_usage_error
from helpers.training import OPTIMIZER, PLANS, SEED, global_batches, plan, rel

INTERVAL = 2
LONGER = 12                      # a resume that extends --iters from TOTAL (8) to 12
GBS = 8                          # tiny plans' global batch


def _train(rank, world, the_plan, batches, options, *, settings=OPTIMIZER, iters=TOTAL):
    """A job as autohet train runs it; (loss, grad norm, lr used) of each iteration trained."""
    from megatron_autohet.checkpoint.checkpointer import Checkpointer
    from megatron_autohet.runtime.optimizer import make_lr_scheduler
    from megatron_autohet.runtime.trainer import HeteroTrainer, train_iterations

    trainer = HeteroTrainer(the_plan, the_plan.model, rank=rank, seed=SEED, optimizer=settings)
    scheduler = make_lr_scheduler(trainer.optimizer, settings, iters, the_plan.global_batch_size)
    checkpointer = Checkpointer(options, trainer, scheduler, seed=SEED, train_args={})
    metrics = []
    original = trainer.train_step

    def recording_step(batch):
        lr = trainer.optimizer.param_groups[0]["lr"]
        step = original(batch)
        metrics.append((step.loss, step.grad_norm, lr))
        return step

    trainer.train_step = recording_step
    train_iterations(trainer, Batches(batches), scheduler, train_iters=iters,
                     scheduler_increment=the_plan.global_batch_size, log=False,
                     checkpointer=checkpointer)
    return metrics


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(metrics of an uninterrupted TOTAL-iteration run, its batches for LONGER iterations, its
    --save directory holding steps 2, 4, 6 and 8)."""
    a = plan("tiny-two-pipelines")
    batches = global_batches(a, LONGER)
    root = tmp_path_factory.mktemp("ckpt")
    options = CheckpointOptions(save=str(root), save_interval=INTERVAL, keep=4)
    full = run_on_ranks(a.world_size, _train, a, batches, options)[0]
    assert len(full) == TOTAL
    return full, batches, root


@pytest.fixture
def load(saved, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(saved[2], copy)
    return copy


def _fresh_lrs(settings_lr, min_lr, warmup_iters, decay_iters, style, start_samples, count):
    """The learning rates a fresh megatron-core scheduler gives ``count`` iterations from
    ``start_samples`` on (each iteration GBS samples), for hand-written flags."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=settings_lr, min_lr=min_lr,
        lr_warmup_steps=warmup_iters * GBS, lr_decay_steps=decay_iters * GBS,
        lr_decay_style=style, start_wd=0.1, end_wd=0.1, wd_incr_steps=decay_iters * GBS,
        wd_incr_style="constant")
    scheduler.step(start_samples)
    lrs = []
    for _ in range(count):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(GBS)
    return lrs


# ---- the learning-rate schedule on resume ------------------------------------------------------

@pytest.mark.integration
def test_override_extends_iters_with_this_runs_schedule_on_another_plan(saved, load):
    """--iters 8 -> 12 from step 8, on another plan: the decay is stretched to 12 iterations and
    continues at 64 samples (OPTIMIZER: lr 3e-3, min 3e-4, warm-up 1, cosine)."""
    _, batches, _ = saved
    b = plan("tiny-homogeneous")
    settings = replace(OPTIMIZER, override_opt_param_scheduler=True)
    rest = run_on_ranks(b.world_size, _train, b, batches, CheckpointOptions(load=str(load)),
                        settings=settings, iters=LONGER)[0]
    expected = _fresh_lrs(3e-3, 3e-4, 1, LONGER, "cosine", TOTAL * GBS, LONGER - TOTAL)
    assert [m[2] for m in rest] == expected
    # the checkpoint's schedule had already decayed to --min-lr at 8 iterations
    assert all(lr > 3e-4 for lr in expected[:-1])


@pytest.mark.e2e
def test_changed_schedule_without_a_flag_is_one_line(saved, load, capsys):
    train = ["train", "--plan", PLANS / "tiny-two-pipelines.yaml",
             "--model", PLANS.parent / "models" / "tiny.yaml", "--load", load,
             "--lr", "3e-3", "--min-lr", "3e-4", "--weight-decay", "0.1",
             "--lr-warmup-iters", "1", "--lr-decay-style", "cosine"]
    step = load / step_dir_name(TOTAL)
    expect_usage_error(
        capsys, train + ["--iters", LONGER],
        "autohet train: error: <command line>: field '--lr-decay-iters': this run's "
        f"learning-rate schedule has lr_decay_steps 96, {step} was trained with 64 (allowed: "
        "the checkpoint's flags (the schedule continues where it stopped), or "
        "--override-opt-param-scheduler (this run's schedule, from the checkpoint's sample count "
        "on) or --use-checkpoint-opt-param-scheduler (the checkpoint's schedule))")
    from megatron_autohet.cli.train import check_resume
    from megatron_autohet.plan import load_plan
    the_plan = load_plan(PLANS / "tiny-two-pipelines.yaml")
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        check_resume(CheckpointOptions(load=str(load)), the_plan,
                     replace(OPTIMIZER, **{flag: True}), LONGER)           # accepted
    check_resume(CheckpointOptions(load=str(load), finetune=True), the_plan, OPTIMIZER,
                 LONGER)                                                  # schedule not loaded


@pytest.mark.integration
def test_use_checkpoint_schedule_continues_although_the_flags_differ(saved, load):
    """--ckpt-step 4 (not the newest, 8), --iters 12 and another --lr: iterations 5-8 repeat the
    saving run exactly (losses, norms, learning rates), then the checkpoint's schedule, decayed
    at 64 samples, stays at its --min-lr."""
    full, batches, _ = saved
    a = plan("tiny-two-pipelines")
    settings = replace(OPTIMIZER, lr=1e-2, use_checkpoint_opt_param_scheduler=True)
    rest = run_on_ranks(a.world_size, _train, a, batches,
                        CheckpointOptions(load=str(load), ckpt_step=4), settings=settings,
                        iters=LONGER)[0]
    assert len(rest) == LONGER - 4
    assert rest[:4] == full[4:]                                            # bit-identical
    assert [m[2] for m in rest[4:]] == [3e-4] * 4


@pytest.mark.integration
def test_ckpt_step_loads_the_older_step_on_another_plan(saved, load):
    full, batches, _ = saved
    b = plan("tiny-homogeneous")
    rest = run_on_ranks(b.world_size, _train, b, batches,
                        CheckpointOptions(load=str(load), ckpt_step=2))[0]
    assert len(rest) == TOTAL - 2
    assert [m[2] for m in rest] == [m[2] for m in full[2:]]
    assert max(max(rel(x[0], y[0]), rel(x[1], y[1])) for x, y in zip(rest, full[2:])) <= 1e-6


# ---- what a load takes: inspected right after resume() ---------------------------------------

def _loaded_state(rank, world, the_plan, options_list, settings_list):
    """For each (options, settings): resume a fresh trainer (RNG reseeded to 999 first) and
    report what it holds, or the ConfigError's line."""
    import torch

    from megatron_autohet.checkpoint.checkpointer import Checkpointer
    from megatron_autohet.runtime.optimizer import make_lr_scheduler
    from megatron_autohet.runtime.trainer import HeteroTrainer

    out = []
    for options, settings in zip(options_list, settings_list):
        trainer = HeteroTrainer(the_plan, the_plan.model, rank=rank, seed=SEED,
                                optimizer=settings)
        scheduler = make_lr_scheduler(trainer.optimizer, settings, TOTAL,
                                      the_plan.global_batch_size)
        checkpointer = Checkpointer(options, trainer, scheduler, seed=SEED, train_args={})
        torch.manual_seed(999)
        before = torch.get_rng_state()
        try:
            progress = checkpointer.resume()
        except ConfigError as err:
            out.append(str(err))
            continue
        out.append({
            "progress": (progress.iteration, progress.consumed_train_samples),
            "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "adam": {n: {k: v.clone() for k, v in trainer.optimizer.state.get(p, {}).items()}
                     for n, p in trainer.model.named_parameters()},
            "num_steps": scheduler.num_steps,
            "rng_kept": torch.equal(torch.get_rng_state(), before)})
    return out


@pytest.mark.integration
def test_finetune_no_load_optim_no_load_rng_and_refusals_on_the_ranks(saved, load):
    import torch

    a = plan("tiny-two-pipelines")
    step4 = dict(load=str(load), ckpt_step=4)
    cases = [CheckpointOptions(**step4), CheckpointOptions(**step4, finetune=True),
             CheckpointOptions(**step4, no_load_optim=True),
             CheckpointOptions(**step4, no_load_rng=True),
             CheckpointOptions(load=str(load), ckpt_step=3), CheckpointOptions(**step4)]
    settings = [OPTIMIZER] * 5 + [replace(OPTIMIZER, min_lr=1e-4)]
    results = run_on_ranks(a.world_size, _loaded_state, a, cases, settings)
    for rank_results in results:
        full, finetune, no_optim, no_rng, missing, other_schedule = rank_results
        assert full["progress"] == (4, 32) and full["num_steps"] == 32
        assert all(s["step"] == 4 for s in full["adam"].values())
        assert not full["rng_kept"]                              # the saved RNG state came back
        for partial in (finetune, no_optim, no_rng):
            assert partial["weights"].keys() == full["weights"].keys()
            assert all(torch.equal(partial["weights"][n], w) for n, w in full["weights"].items())
        assert finetune["progress"] == (0, 0) and finetune["num_steps"] == 0
        assert finetune["rng_kept"] and all(not s for s in finetune["adam"].values())
        assert no_optim["progress"] == (4, 32) and no_optim["num_steps"] == 0
        assert not no_optim["rng_kept"] and all(not s for s in no_optim["adam"].values())
        assert no_rng["progress"] == (4, 32) and no_rng["rng_kept"]
        assert all(torch.equal(no_rng["adam"][n]["exp_avg"], s["exp_avg"])
                   for n, s in full["adam"].items())
        assert missing == (f"<command line>: field '--ckpt-step': no committed step 3 in {load} "
                           "(allowed: one of the committed steps: 2, 4, 6, 8)")
        assert other_schedule.startswith(
            "<command line>: field '--min-lr': this run's learning-rate schedule has min_lr "
            "0.0001, the checkpoint's iteration 4 was trained with 0.0003 (allowed: ")


# ---- bad combinations: one line, exit 2, before any process ----------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("flags, message", [
    (["--finetune"], "field '--finetune': given without --load (allowed: with --load DIR (it "
                     "says what a resume takes from the step))"),
    (["--no-load-rng"], "field '--no-load-rng': given without --load (allowed: with --load DIR "
                        "(it says what a resume takes from the step))"),
    (["--load", "{load}", "--ckpt-step", "0"],
     "field '--ckpt-step': got 0 (allowed: the iteration of a saved step (> 0))"),
    (["--load", "{load}", "--ckpt-step", "5"],
     "field '--ckpt-step': no committed step 5 in {load} (allowed: one of the committed steps: "
     "2, 4, 6, 8)"),
    (["--load", "{load}", "--override-opt-param-scheduler",
      "--use-checkpoint-opt-param-scheduler"],
     "field '--override-opt-param-scheduler': given with --use-checkpoint-opt-param-scheduler "
     "(allowed: one of them: this run's schedule (override) or the checkpoint's)"),
    (["--load", "{load}", "--finetune", "--override-opt-param-scheduler"],
     "field '--override-opt-param-scheduler': given with --finetune (allowed: not with them: "
     "the checkpoint's schedule is not loaded, the schedule starts fresh from this run's flags)"),
    (["--use-checkpoint-opt-param-scheduler"],
     "field '--use-checkpoint-opt-param-scheduler': given without --load (allowed: with --load "
     "DIR (it says which schedule a resume continues))"),
])
def test_bad_combinations_are_one_line_and_exit_2(flags, message, load, capsys):
    train = ["train", "--plan", PLANS / "tiny-two-pipelines.yaml",
             "--model", PLANS.parent / "models" / "tiny.yaml"]
    flags = [f.replace("{load}", str(load)) for f in flags]
    expect_usage_error(capsys, train + flags, "autohet train: error: <command line>: "
                       + message.replace("{load}", str(load)))
