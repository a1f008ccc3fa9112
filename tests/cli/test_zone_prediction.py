"""`autohet show` and `autohet compare` on a fleet across zones: the prediction states the
egress the plan pays per iteration, compare's price column says it includes it (the cost
model's figures, cost_model.py "Zones")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_autohet.cli.main import main
from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.plan import load_plan
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.spec import load_cluster

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PLAN = CONFIGS / "plans" / "tiny-two-pipelines.yaml"
TINY = CONFIGS / "models" / "tiny.yaml"


def _local4(tmp_path: Path, zones: bool) -> Path:
    """configs/clusters/local-4.yaml with spot prices, the A100 node in one zone and the others
    in another."""
    data = yaml.safe_load((CONFIGS / "clusters" / "local-4.yaml").read_text())
    for node in data["nodes"]:
        node["spot_price"] = 1.0
        if zones:
            node["zone"] = "a" if node["gpu"] == "A100-80GB" else "b"
    if zones:
        data["zones"] = {"a": "r", "b": "r"}
    path = tmp_path / ("zoned.yaml" if zones else "plain.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def _run(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


@pytest.mark.unit
def test_show_states_the_egress_per_iteration(capsys, tmp_path):
    zoned = _local4(tmp_path, zones=True)
    plan = load_plan(PLAN)
    cluster = load_cluster(zoned)
    cost = evaluate_plan(plan, cluster, resolve_profile(cluster, plan.model, None,
                                                        plan.micro_batch_size, plan.seq_length))
    assert cost.egress_usd_per_iteration > 0
    out = _run(capsys, "show", PLAN, "--cluster", zoned)
    assert (f"+ ${cost.egress_usd_per_iteration:.4g} of egress per iteration (bytes crossing "
            "zones)") in out
    assert "egress" not in _run(capsys, "show", PLAN, "--cluster", _local4(tmp_path, False))


@pytest.mark.integration
def test_compare_prices_include_the_egress(capsys, tmp_path):
    argv = ["compare", "--model", TINY, "--global-batch-size", 8, "--micro-batch-size", 2]
    zoned, plain = _local4(tmp_path, zones=True), _local4(tmp_path, zones=False)
    assert "$/1M tokens (per-node, egress included)" in _run(capsys, *argv, "--cluster", zoned)
    assert "$/1M tokens (per-node)" in _run(capsys, *argv, "--cluster", plain)
    data = json.loads(_run(capsys, *argv, "--cluster", zoned, "--json"))
    for entry in [data["autohet"]] + [b for b in data["baselines"] if b["tokens_per_s"]]:
        iteration = entry["iteration_time_s"]
        tokens = 8 * 64
        assert entry["usd_per_million_tokens"] == pytest.approx(
            (entry["usd_per_hour"] / 3600 * iteration + entry["egress_usd_per_iteration"])
            / tokens * 1e6)
    assert any(b["egress_usd_per_iteration"] for b in data["baselines"])
