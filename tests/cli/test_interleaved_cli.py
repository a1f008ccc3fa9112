"""The front end on an interleaved pipeline (``virtual_stages``): `autohet show`'s table lists each
stage's layers chunk by chunk, its figure draws a box per chunk where its layers are and says v;
`autohet train --overlap-grad-reduce` is refused in one line before any rank starts."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest

from helpers.cli import run_cli
from helpers.training import interleaved_plan
from megatron_autohet.cli._common import format_plan_table
from megatron_autohet.cli.show import plan_figure, predict

matplotlib.use("Agg")

pytestmark = pytest.mark.unit


class _Args:
    cluster = profile = gpu_catalog = None


def _plan():
    return interleaved_plan("tiny-two-pipelines.yaml",
                            {0: [[(0, 2), (3, 5)], [(2, 3), (5, 6)]]}, {0: 4})


def test_table_lists_every_chunk_of_a_stage():
    rows = format_plan_table(_plan()).splitlines()
    assert "0-1,3-4" in rows[2] and " 2,5 " in rows[3] and " 0-5 " in rows[4]


def test_figure_draws_a_box_per_chunk():
    plan = _plan()
    fig = plan_figure(plan, predict(plan, _Args()))
    boxes = sorted((round(bar.get_x()), round(bar.get_width()), round(bar.get_y() + 0.4))
                   for bar in fig.axes[0].patches)
    # pipeline 0 (the upper row, y = 1): chunks [0, 2) [3, 5) on stage 0, [2, 3) [5, 6) on 1
    assert boxes == [(0, 2, 1), (0, 6, 0), (2, 1, 1), (3, 2, 1), (5, 1, 1)]
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks == ["pipeline 1\n1 mb", "pipeline 0\n4 mb, v=2"]


def test_train_refuses_overlap_on_an_interleaved_plan_before_any_rank_starts(tmp_path, capsys):
    plan_file = tmp_path / "plan.yaml"
    _plan().save(plan_file)
    model = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny.yaml"
    rc, out, err = run_cli(capsys, "train", "--plan", plan_file, "--model", model, "--iters", 1,
                           "--overlap-grad-reduce", "--data-dir", tmp_path / "data")
    assert rc == 2 and out == ""
    assert err.splitlines() == [
        f"autohet train: error: {plan_file}: field 'overlap_grad_reduce': overlapped gradient "
        "sync (the plan's field or --overlap-grad-reduce) with pipelines[0].virtual_stages 2 "
        "(allowed: no overlap on a plan with interleaved pipelines: megatron's interleaved "
        "schedule re-enables the sync before each chunk's last backward, the runtime has one "
        "no-sync switch per stage)"]
