"""Every planning path honours the job's precision the same way (spec/cluster.py
``trainable_fleet``): ``autohet plan`` (tests/spec/test_bf16_support.py), ``autohet compare``
and ``autohet replan`` leave GPUs without bf16 (V100, T4) idle in a bf16 plan and record them
so, and use them in an fp32 one (the elastic worker's re-plan: tests/elastic/
test_replan_precision.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import check_bf16_support, load_plan
from megatron_autohet.planner import make_plan, search
from megatron_autohet.planner.compare import compare
from megatron_autohet.planner.replan import replan
from megatron_autohet.spec import load_model
from megatron_autohet.spec.cluster import cluster_from_dict
from megatron_autohet.spec.gpus import load_gpu_catalog

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GPT = load_model(CONFIGS / "models" / "gpt3-1.3b.yaml")
CATALOG = load_gpu_catalog()

pytestmark = pytest.mark.unit


def _cluster(name: str, nodes: list[tuple[str, str, int]]):
    return cluster_from_dict({"name": name, "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": n, "gpu": gpu, "gpus": count} for n, gpu, count in nodes]})


LONE = _cluster("lone", [("h20", "H20", 1)])
GROWN = _cluster("grown", [("h20", "H20", 1), ("v100", "V100-32GB", 1)])


@pytest.fixture(scope="module")
def previous():
    """GPT-3 1.3B planned on a lone H20 (bf16 estimates)."""
    return make_plan(LONE, GPT, None, 16, 1, progress=False)


def test_replan_leaves_a_joined_v100_idle_in_a_bf16_job(previous):
    """A V100 joins: a bf16 re-plan (the estimates' precision, or the job's) keeps it idle and
    records it so; the same fleet again is unchanged. An fp32 job uses it (it halves the
    iteration time), so the precision, not the GPU type, decides."""
    for precision in (None, "bf16"):
        result = replan(previous, GROWN, GPT, precision=precision)
        assert {r.gpu for r in result.plan.ranks} == {"H20"}
        assert result.cost.idle_gpus == {"V100-32GB": 1}
        assert result.plan.predicted["idle_gpus"] == {"V100-32GB": 1}
        assert result.recovery_bytes == 0
        check_bf16_support(result.plan, CATALOG)
        again = replan(result.plan, GROWN, GPT, precision=precision)
        assert again.unchanged and again.plan is result.plan
    fp32 = replan(previous, GROWN, GPT, precision="fp32")
    assert "V100-32GB" in {r.gpu for r in fp32.plan.ranks} and not fp32.cost.idle_gpus


def test_a_plan_on_a_v100_is_replanned_for_a_bf16_job(previous):
    """An fp32 plan that uses the V100 on an unchanged fleet is no plan for a bf16 job: it is
    re-planned without it."""
    fp32 = replan(previous, GROWN, GPT, precision="fp32").plan
    assert replan(fp32, GROWN, GPT, precision="fp32").unchanged
    result = replan(fp32, GROWN, GPT, precision="bf16")
    assert not result.unchanged and {r.gpu for r in result.plan.ranks} == {"H20"}


def test_replan_refuses_a_fleet_without_bf16(previous):
    with pytest.raises(ConfigError) as err:
        replan(previous, _cluster("v", [("v100", "V100-32GB", 2)]), GPT, cluster_file="now.yaml")
    assert str(err.value).startswith("now.yaml: field 'nodes': no GPU with bf16 (V100-32GB")


def test_cli_replan_with_a_v100_joining(previous, capsys, tmp_path):
    plan_file, cluster = tmp_path / "old.yaml", tmp_path / "now.yaml"
    previous.save(plan_file)
    cluster.write_text("name: grown\ninter_node_bandwidth_gbs: 25\nnodes:\n"
                       "  - {name: h20, gpu: H20, gpus: 1}\n"
                       "  - {name: v100, gpu: V100-32GB, gpus: 1}\n")
    out_file = tmp_path / "new.yaml"
    rc = main(["replan", "--plan", str(plan_file), "--cluster", str(cluster), "--model",
               str(CONFIGS / "models" / "gpt3-1.3b.yaml"), "-o", str(out_file)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    new = load_plan(out_file)
    assert {r.gpu for r in new.ranks} == {"H20"}
    assert new.predicted["idle_gpus"] == {"V100-32GB": 1}
    assert "idle GPUs (no rank in this plan): 1 x V100-32GB" in out
    only_v100 = tmp_path / "v.yaml"
    only_v100.write_text("name: v\ninter_node_bandwidth_gbs: 25\nnodes:\n"
                         "  - {name: v100, gpu: V100-32GB, gpus: 2}\n")
    rc = main(["replan", "--plan", str(plan_file), "--cluster", str(only_v100), "--model",
               str(CONFIGS / "models" / "gpt3-1.3b.yaml"), "-o", str(tmp_path / "v-plan.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"{only_v100}: field 'nodes': no GPU with bf16 (V100-32GB have bf16: false" in err[0]
    assert not (tmp_path / "v-plan.yaml").exists()


def test_compare_runs_every_plan_on_the_bf16_gpus():
    """Ours and the baselines alike: a bf16 job of any kind has no use for the V100s."""
    cluster = _cluster("mixed", [("a", "A100-80GB", 2), ("v", "V100-32GB", 2)])
    result = compare(cluster, GPT, None, 16, 1, progress=False, time_limit_s=30)
    assert {r.gpu for r in result.plan.ranks} == {"A100-80GB"}
    assert result.cost.idle_gpus.get("V100-32GB") == 2
    assert result.plan.predicted["idle_gpus"]["V100-32GB"] == 2
    judged = [b for b in result.baselines if b.plan is not None]
    assert judged
    for b in judged:
        assert "V100-32GB" not in {r.gpu for r in b.plan.ranks}, b.name
        assert b.cost.idle_gpus.get("V100-32GB") == 2, b.name



def test_search_plans_on_the_fleet_autohet_plan_does(tmp_path, capsys):
    """planner.search() (and make_plan) decide the fleet as `autohet plan` does (space.py
    trainable_for, one decision): a bf16 plan leaves the V100s idle and records them, an fp32
    job uses them, a fleet of V100s alone is refused naming the cluster file."""
    cluster = _cluster("mixed", [("a", "A100-80GB", 2), ("v", "V100-32GB", 2)])
    best = search(cluster, GPT, None, 16, 1, progress=False)
    assert {r.gpu for r in best.plan.ranks} == {"A100-80GB"}
    assert best.cost.idle_gpus.get("V100-32GB") == 2
    assert best.plan.predicted["idle_gpus"]["V100-32GB"] == 2
    check_bf16_support(best.plan, CATALOG)
    path = tmp_path / "mixed.yaml"
    path.write_text("name: mixed\ninter_node_bandwidth_gbs: 25\nnodes:\n"
                    "  - {name: a, gpu: A100-80GB, gpus: 2}\n"
                    "  - {name: v, gpu: V100-32GB, gpus: 2}\n")
    assert main(["plan", "--cluster", str(path), "--model",
                 str(CONFIGS / "models" / "gpt3-1.3b.yaml"), "--global-batch-size", "16",
                 "-o", str(tmp_path / "p.yaml")]) == 0
    assert "left out, no bf16: 2 x V100-32GB" in capsys.readouterr().out
    assert load_plan(tmp_path / "p.yaml").predicted["iteration_time_s"] == pytest.approx(
        best.cost.iteration_time_s, rel=1e-5)
    fp32 = search(cluster, GPT, None, 16, 1, progress=False, precision="fp32")
    assert "V100-32GB" in {r.gpu for r in fp32.plan.ranks}
    with pytest.raises(ConfigError) as err:
        search(_cluster("v", [("v", "V100-32GB", 2)]), GPT, None, 16, 1, progress=False,
               cluster_file="v.yaml")
    assert str(err.value).startswith("v.yaml: field 'nodes': no GPU with bf16 (V100-32GB")
