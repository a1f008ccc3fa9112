"""The elastic worker's re-plan (the one a new round and the in-process re-plan after a notice
both make, ElasticWorker._replan) takes its job's precision, as every planning path does
(spec/cluster.py ``trainable_fleet``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_autohet.planner import make_plan
from megatron_autohet.spec import load_model
from megatron_autohet.spec.cluster import cluster_from_dict

ROOT = Path(__file__).resolve().parents[2]
GPT = load_model(ROOT / "configs/models/gpt3-1.3b.yaml")
# a plan search and two re-plans of GPT-3 1.3B
pytestmark = pytest.mark.integration


def _cluster(name: str, nodes: list[tuple[str, str, int]]):
    return cluster_from_dict({"name": name, "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": n, "gpu": gpu, "gpus": count} for n, gpu, count in nodes]})


GROWN = _cluster("grown", [("h20", "H20", 1), ("v100", "V100-32GB", 1)])


@pytest.fixture(scope="module")
def previous():
    """GPT-3 1.3B planned on a lone H20."""
    return make_plan(_cluster("lone", [("h20", "H20", 1)]), GPT, None, 16, 1, progress=False)


@pytest.mark.parametrize("precision, used", [("bf16", {"H20"}), ("fp32", {"H20", "V100-32GB"})])
def test_elastic_worker_replans_for_its_jobs_precision(previous, monkeypatch, precision, used):
    """A V100 joins: --bf16 leaves it idle; an fp32 job (a CPU's default) uses it."""
    from megatron_autohet.elastic.fleet import Member
    from megatron_autohet.elastic.worker import ElasticWorker
    from megatron_autohet.job import TrainOptions
    from megatron_autohet.runtime.optimizer import OptimizerSettings

    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "AUTOHET_NODE": "h20",
                       "AUTOHET_GPU": "H20"}.items():
        monkeypatch.setenv(key, value)
    worker = ElasticWorker(initial_plan=previous, template=GROWN, model=GPT,
                           options=TrainOptions(iters=1, seed=0, precision=precision,
                                                optimizer=OptimizerSettings(lr=1e-4)),
                           notice_file=None, events_jsonl=None)
    plan, decision = worker._decide([Member("h20", "H20", 0), Member("v100", "V100-32GB", 0)], [])
    assert {r.gpu for r in plan.ranks} == used, decision
