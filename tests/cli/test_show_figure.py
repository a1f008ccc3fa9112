"""`autohet show --figure`'s drawing (cli/show.py plan_figure) read back from matplotlib's own
objects: every mark of the timeline is in its legend and no two phases share a look, the time axis
reads in a unit that suits the iteration, counts are singular where they are one, and a figure
drawn without the plan's cluster says which flag adds the timeline."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest
import yaml
from matplotlib.colors import to_rgba

from helpers.cli import run_cli
from megatron_autohet.cli.show import plan_figure, predict, time_unit
from megatron_autohet.plan import load_plan

matplotlib.use("Agg")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PLAN = CONFIGS / "plans" / "tiny-two-pipelines.yaml"     # on the bundled local-4


class _Args:
    cluster = profile = gpu_catalog = None


def _timeline(plan_file: Path = PLAN):
    plan = load_plan(plan_file)
    fig = plan_figure(plan, predict(plan, _Args()))
    fig.canvas.draw()
    return fig, fig.axes[1]


@pytest.mark.unit
def test_every_mark_of_the_timeline_has_its_own_legend_entry():
    fig, ax = _timeline()
    legend = ax.get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["forward (light shade)", "backward (full colour)", "gradient sync",
                      "optimizer step", "pipelines drained", "iteration end"]
    patches, lines = legend.get_patches(), legend.get_lines()
    looks = [(to_rgba(p.get_facecolor()), p.get_hatch()) for p in patches]
    assert len(set(looks)) == 4, looks                  # the four phases look different
    backward, optimizer = looks[1], looks[3]
    assert backward[0] != optimizer[0]
    # the two vertical lines drawn are the two legend lines: same colour and style
    drawn = [(to_rgba(line.get_color()), line.get_linestyle()) for line in ax.get_lines()]
    assert drawn == [(to_rgba(line.get_color()), line.get_linestyle()) for line in lines[-2:]]


@pytest.mark.unit
def test_a_tiny_iteration_reads_in_microseconds_without_an_offset():
    fig, ax = _timeline()
    assert ax.get_xlabel() == "time in the iteration (µs)"
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert ticks[:3] == ["0", "20", "40"], ticks
    assert ax.xaxis.get_offset_text().get_text() == ""
    assert "iteration 91.9 µs" in ax.get_title()


@pytest.mark.unit
def test_time_units():
    assert time_unit(2.5) == (1.0, "s") and time_unit(0.266) == (1e3, "ms")
    assert time_unit(9.19e-5) == (1e6, "µs")


@pytest.mark.integration
def test_one_pipeline_is_singular(capsys, tmp_path):
    plan_file, figure = tmp_path / "one.yaml", tmp_path / "one.png"
    rc, _, err = run_cli(capsys, "plan", "--cluster", CONFIGS / "clusters" / "one-h100.yaml",
                         "--model", CONFIGS / "models" / "tiny.yaml", "--global-batch-size", 4,
                         "--micro-batch-size", 2, "-o", plan_file)
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "show", plan_file, "--figure", figure)
    assert rc == 0, err
    assert out.splitlines()[0] == f"plan {plan_file}: tiny on one-h100, 1 GPU, 1 pipeline"
    fig, _ = _timeline(plan_file)
    assert fig.axes[0].get_title().startswith("tiny on one-h100: 1 GPU, 1 pipeline, global batch")


@pytest.mark.unit
def test_a_figure_without_the_plans_cluster_says_which_flag_adds_the_timeline(capsys, tmp_path):
    raw = yaml.safe_load(PLAN.read_text())
    raw["cluster"] = "my-own-fleet"
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(raw))
    rc, out, _ = run_cli(capsys, "show", plan_file, "--figure", tmp_path / "plan.png")
    assert rc == 0
    assert out.splitlines()[-1] == ("> no timeline in the figure: no bundled cluster is named "
                                    "'my-own-fleet'; --cluster C.yaml (the plan's cluster) adds it")
    cluster = tmp_path / "my-own-fleet.yaml"
    cluster.write_text((CONFIGS / "clusters" / "local-4.yaml").read_text().replace(
        "name: local-4", "name: my-own-fleet"))
    rc, out, _ = run_cli(capsys, "show", plan_file, "--figure", tmp_path / "plan.png",
                         "--cluster", cluster)
    assert rc == 0 and "no timeline" not in out
