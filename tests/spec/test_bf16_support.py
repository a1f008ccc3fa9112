"""GPUs without bf16 (the catalog's ``bf16: false``: V100, T4) never get a bf16 plan to train.

The runtime's one 16-bit precision is bf16 (fp16 needs a dynamic loss scaler it does not have),
so ``autohet plan`` makes a bf16-priced plan without such GPUs (idle; a fleet of only those is
refused) and ``autohet train`` refuses a plan that would train bf16 on one: one line naming the
stage, exit 2.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from megatron_autohet.cli.main import main
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import check_bf16_support, load_plan
from megatron_autohet.spec.gpus import load_gpu_catalog

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY_PLAN = CONFIGS / "plans" / "tiny-two-pipelines.yaml"
TINY = CONFIGS / "models" / "tiny.yaml"
GPT = CONFIGS / "models" / "gpt3-1.3b.yaml"
CATALOG = load_gpu_catalog()


def _on_gpu(plan, node: str, gpu: str):
    """The plan with every rank of ``node`` on a ``gpu``."""
    return replace(plan, ranks=[replace(r, gpu=gpu) if r.node == node else r
                                for r in plan.ranks])


def test_a_stage_on_a_gpu_without_bf16_is_named():
    plan = load_plan(TINY_PLAN)
    check_bf16_support(plan, CATALOG, "p.yaml")                  # A100, H800, H20: fine
    with pytest.raises(ConfigError) as err:
        check_bf16_support(_on_gpu(plan, "h800", "V100-32GB"), CATALOG, "p.yaml")
    assert err.value.field == "pipelines[0].stages[1]"
    assert "plan stage 1 of pipeline 0 on V100-32GB: bf16 not supported" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="a plan without T4, V100-32GB GPUs"):
        check_bf16_support(_on_gpu(_on_gpu(plan, "h800", "V100-32GB"), "h20", "T4"), CATALOG)
    check_bf16_support(_on_gpu(plan, "h800", "EMU-FAST"), CATALOG)   # not in the catalog


def _cluster(tmp_path, nodes) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"name": "c", "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": name, "gpu": gpu, "gpus": n} for name, gpu, n in nodes]}))
    return path


def test_plan_leaves_gpus_without_bf16_idle(capsys, tmp_path):
    cluster = _cluster(tmp_path, [("a", "A100-80GB", 2), ("v", "V100-32GB", 2), ("t", "T4", 1)])
    out_file = tmp_path / "plan.yaml"
    assert main(["plan", "--cluster", str(cluster), "--model", str(GPT),
                 "--global-batch-size", "16", "-o", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "2 GPUs (2 x A100-80GB; left out, no bf16: 2 x V100-32GB, 1 x T4)" in out
    assert "idle GPUs (no rank in this plan): 2 x V100-32GB, 1 x T4" in out
    plan = load_plan(out_file)
    assert {r.gpu for r in plan.ranks} == {"A100-80GB"} and plan.cluster == "c"
    assert plan.predicted["idle_gpus"] == {"V100-32GB": 2, "T4": 1}
    check_bf16_support(plan, CATALOG)


def test_plan_refuses_a_fleet_without_bf16(capsys, tmp_path):
    cluster = _cluster(tmp_path, [("v", "V100-32GB", 2), ("t", "T4", 1)])
    rc = main(["plan", "--cluster", str(cluster), "--model", str(GPT),
               "--global-batch-size", "16", "-o", str(tmp_path / "plan.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"{cluster}: field 'nodes': no GPU with bf16 (T4, V100-32GB" in err[0]
    assert not (tmp_path / "plan.yaml").exists()


def test_train_refuses_bf16_on_a_t4_before_launching(capsys, tmp_path):
    plan_file = tmp_path / "plan.yaml"
    _on_gpu(load_plan(TINY_PLAN), "h20", "T4").save(plan_file)
    rc = main(["train", "--plan", str(plan_file), "--model", str(TINY), "--iters", "1",
               "--bf16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"{plan_file}: field 'pipelines[1].stages[0]'" in err[0]
    assert "plan stage 0 of pipeline 1 on T4: bf16 not supported" in err[0]
