"""An elastic job's re-plan prices plans on the profile its plan was priced on: the
plan records the profile (``autohet plan --profile``), and the worker's re-plan - which has none
of `autohet plan`'s flags - prices on it, not on the analytic estimates, and records it in the
new plan for the next re-plan."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.training import plan as proof_plan
from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.plan import plan_from_dict
from megatron_autohet.planner.search import make_plan
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.profiling.estimate import estimate_profile
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import cluster_from_dict

# two plan searches of the tiny model
pytestmark = pytest.mark.integration

MODEL = proof_plan("tiny-homogeneous").model
MBS, SEQ, GBS = 2, 64, 8
SLOWER = 5.0                # the measured A100 against its datasheet estimate


def _cluster(nodes: dict[str, str]):
    return cluster_from_dict({"name": "+".join(nodes), "inter_node_bandwidth_gbs": 25,
                              "nodes": [{"name": n, "gpu": g, "gpus": 1}
                                        for n, g in nodes.items()]})


BOTH = _cluster({"a100": "A100-80GB", "h20": "H20"})
STAYING = _cluster({"a100": "A100-80GB"})


def _measured() -> Profile:
    """The A100's entries as `autohet profile` would have measured them: SLOWER times the
    estimate."""
    estimate = estimate_profile(MODEL, STAYING, MBS, SEQ)
    profile = Profile(MODEL.name)
    for entry in estimate.entries.values():
        profile.add(replace(entry, **{part: replace(
            getattr(entry, part), forward_s=getattr(entry, part).forward_s * SLOWER,
            backward_s=getattr(entry, part).backward_s * SLOWER, source="measured")
            for part in ("layer", "embedding", "output")}))
    return profile


def test_the_elastic_replan_prices_on_the_plans_profile(monkeypatch):
    from megatron_autohet.elastic.worker import ElasticWorker
    from megatron_autohet.job import TrainOptions
    from megatron_autohet.runtime.optimizer import OptimizerSettings

    profile = _measured()
    planned = make_plan(BOTH, MODEL, profile, GBS, MBS, SEQ, progress=False)
    previous = plan_from_dict(planned.to_dict(), "<plan file>")      # as the job reads it
    assert previous.profile == profile.to_dict()
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "AUTOHET_NODE": "a100",
                       "AUTOHET_GPU": "A100-80GB"}.items():
        monkeypatch.setenv(key, value)
    worker = ElasticWorker(initial_plan=previous, template=BOTH, model=MODEL,
                           options=TrainOptions(iters=1, seed=0, precision="bf16",
                                                optimizer=OptimizerSettings(lr=1e-4)),
                           notice_file=None, events_jsonl=None)
    found = worker._replan(previous, STAYING, "h20 lost")              # h20 is gone
    priced = evaluate_plan(found.plan, STAYING, resolve_profile(STAYING, MODEL, profile, MBS, SEQ),
                           with_timeline=False).iteration_time_s
    analytic = evaluate_plan(found.plan, STAYING, estimate_profile(MODEL, STAYING, MBS, SEQ),
                             with_timeline=False).iteration_time_s
    assert found.cost.iteration_time_s == pytest.approx(priced, rel=1e-9)
    assert priced > 2 * analytic                    # the two pricings are far apart
    assert found.plan.profile == profile.to_dict()  # and the next re-plan prices the same
