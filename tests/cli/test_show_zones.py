"""`autohet show` on a cluster across zones: the table has each stage's zone, the figure hatches
each stage by its zone, labels it, draws a red line where a pipeline's boundary crosses zones
(each one, and no other) and names the zone in each timeline row; on a cluster without zones
neither the column nor any of these marks."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest

from helpers.cli import run_cli
from megatron_autohet.cli._common import format_plan_table
from megatron_autohet.cli.show import ZONE_CROSSING_STYLE, node_zones, plan_figure, predict
from megatron_autohet.plan import load_plan
from megatron_autohet.spec.cluster import load_cluster

matplotlib.use("Agg")
pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs" / "plans" / "tiny-two-pipelines.yaml"   # a100 -> h800, and h20 alone
LOCAL_4 = ROOT / "configs" / "clusters" / "local-4.yaml"
# local-4's nodes in two zones: a100 in x, h800 and h20 in y
ZONED = """name: local-4
inter_node_bandwidth_gbs: 25
zones: {x: r, y: r}
nodes:
  - {name: a100, gpu: A100-80GB, gpus: 2, zone: x}
  - {name: h800, gpu: H800, gpus: 1, zone: y}
  - {name: h20, gpu: H20, gpus: 1, zone: y}
"""


class _Args:
    profile = gpu_catalog = None

    def __init__(self, cluster):
        self.cluster = str(cluster)


def _crossings(ax) -> list:
    red = matplotlib.colors.to_rgba(ZONE_CROSSING_STYLE["color"])
    return [line for line in ax.get_lines() if matplotlib.colors.to_rgba(line.get_color()) == red]


@pytest.fixture
def zoned(tmp_path):
    path = tmp_path / "local-4-zones.yaml"
    path.write_text(ZONED)
    return path


def test_the_table_has_each_stages_zone(zoned, capsys):
    plan = load_plan(PLAN)
    table = format_plan_table(plan, None, load_cluster(zoned)).splitlines()
    assert table[0].split()[:5] == ["pipe", "stage", "ranks", "node", "zone"]
    assert [line.split()[4] if line[0] != " " else line.split()[3] for line in table[2:]] == \
        ["x", "y", "y"]
    plain = format_plan_table(plan, None, load_cluster(LOCAL_4)).splitlines()
    assert "zone" not in plain[0]
    assert plain == format_plan_table(plan, None).splitlines()
    # the command prints it
    rc, out, _ = run_cli(capsys, "show", PLAN, "--cluster", zoned)
    assert rc == 0 and " zone " in out.splitlines()[1]


def test_the_figure_marks_the_zones_and_each_crossing(zoned):
    plan = load_plan(PLAN)
    cluster = load_cluster(zoned)
    zones = node_zones(cluster)
    fig = plan_figure(plan, predict(plan, _Args(zoned)), zones=zones)
    fig.canvas.draw()
    ax_plan, ax_time = fig.axes[0], fig.axes[1]
    # by the plan itself: the boundaries whose two stages sit in different zones
    crossing = sum(zones[plan.ranks[a.ranks[0]].node] != zones[plan.ranks[b.ranks[0]].node]
                   for pipe in plan.pipelines for a, b in zip(pipe.stages, pipe.stages[1:]))
    assert crossing == 1 and len(_crossings(ax_plan)) == crossing
    legends = [c for c in ax_plan.get_children() if isinstance(c, matplotlib.legend.Legend)]
    zone_legend = ax_plan.get_legend()
    assert [t.get_text() for t in zone_legend.get_texts()] == ["x", "y", "crosses zones"]
    assert zone_legend.get_title().get_text() == "zone" and len(legends) == 2
    hatches = [p.get_hatch() for p in zone_legend.get_patches()]
    assert len(set(hatches)) == 2                   # the two zones look different
    boxes = [p for p in ax_plan.patches if p.get_height() == 0.8]
    assert sorted(str(b.get_hatch()) for b in boxes) == sorted(str(h) for h in
                                                               [hatches[0]] + [hatches[1]] * 2)
    texts = [t.get_text() for t in ax_plan.texts]
    assert sorted(t.splitlines()[-1] for t in texts) == ["x", "y", "y"]
    rows = [t.get_text() for t in ax_time.get_yticklabels()]
    assert all(row.split()[-1] in ("x", "y") for row in rows), rows

    # without zones: none of the marks
    fig = plan_figure(plan, predict(plan, _Args(LOCAL_4)), zones=node_zones(load_cluster(LOCAL_4)))
    fig.canvas.draw()
    ax_plan = fig.axes[0]
    assert _crossings(ax_plan) == [] and ax_plan.get_legend().get_title().get_text() == "GPU type"
    assert all(p.get_hatch() is None for p in ax_plan.patches if p.get_height() == 0.8)
