"""--autohet-adapt replan on an elastic job (elastic/worker.py): a window's SWITCH decision moves
the job to the re-plan in its running workers, every member stays, nothing is lost; a fleet
change at the same iteration wins over the switch.

Each test runs the elastic worker's whole loop (``ElasticWorker.run``: the members' store, the
plan agreed, the generations, the standbys, the job's end) on gloo processes, one per GPU of
configs/clusters/local-4.yaml's nodes (emulated: each process names its node and GPU type, as
``autohet node`` passes them). The windows they measure are injected (runtime/trainer.py's
WindowMeter returns tests/helpers/windows.py's synthetic window: the cost model's stage times on
the plan's fleet with one A100 at half speed, every GPU 1e8 times slower than priced, so the
30 s a switch is priced at pays back), never the wall clock: which windows decide what, and
the iteration the job switches after, follow from the plans alone.

The proof of the switch (tiny-two-pipelines, 4 workers): the re-plan leaves the TP2 A100 group
idle, so node a100's files of the switch's step go to the training nodes on the old process
group, its two workers wait as standbys (members still: they finish with the job, status 0), and
the other two train to the end on the new plan's process group; every iteration is logged once
with the loss and grad norm of the uninterrupted run on the same global batches, the same bits
up to the switch, then within the cross-layout bound of the checkpoint tests and of
tests/test_job_replan.py (tests/helpers/checkpointing.py REL, 1e-6 relative: another layout sums
in another order). tests/elastic/test_elastic.py's tighter ``t * micro-batches * u`` holds where
only the micro-batch sums regroup; here the TP2 stage becomes TP1 stages, whose GEMMs sum each
hidden dimension in another order too (measured: up to 9.3e-7 at the first iteration after the
switch, with the switch after iteration 4). Leaving a100's files where they are fails it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import megatron_autohet.elastic.worker as worker_module
import megatron_autohet.runtime.trainer as trainer_module
from helpers.checkpointing import REL
from helpers.dist_utils import run_on_ranks
from helpers.training import plan as load_test_plan
from helpers.training import two_ranks
from helpers.windows import synthetic_window
from megatron_autohet.checkpoint.manifest import committed_steps
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.job import ElasticOptions, TrainOptions
from megatron_autohet.planner.adapt import plan_fleet
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.runtime.stage_drift import WindowMeter
from megatron_autohet.spec.gpus import load_gpu_catalog
from megatron_autohet.system.ports import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "configs/clusters/local-4.yaml"
ITERS, WINDOW = 12, 2
SLOW = {("a100", 1): 0.5}                  # one A100 at half speed
SCALE = 1e8


class InjectedWindows(WindowMeter):
    """The windows of the fleet with SLOW, whatever the clock measured (module doc)."""

    def add(self, iteration, times):
        report = super().add(iteration, times)         # the real gather, on every rank
        if report is None:
            return None
        fleet = plan_fleet(self.plan, load_gpu_catalog()).with_speeds(SLOW)
        return synthetic_window(self.plan, fleet, report.first_iteration,
                                report.last_iteration, scale=SCALE)


def _options(tmp: Path, **fields) -> TrainOptions:
    return TrainOptions(iters=ITERS, seed=1234, optimizer=OptimizerSettings(lr=1e-3),
                        data_dir=str(tmp / "data"), measure_window=WINDOW,
                        distributed_timeout_minutes=2.0, **fields)


def _elastic_options(tmp: Path) -> TrainOptions:
    """As ``autohet node`` makes them: every generation resumes the newest step of its node's
    directory (cli/train.py checkpoint_options)."""
    local = str(tmp / "ckpt-{node}")
    return _options(tmp, adapt="replan", metrics_jsonl=str(tmp / "metrics.jsonl"),
                    checkpoint=CheckpointOptions(local_dir=local, load=local, save_interval=100),
                    elastic=ElasticOptions(cluster=str(CLUSTER),
                                           events_jsonl=str(tmp / "events.jsonl"))).validate()


def _reference(rank, world, plan, options):
    from megatron_autohet.job import train_job
    return train_job(plan, "<reference>", plan.model, options, rank=rank,
                     local_rank=plan.ranks[rank].local_rank)


def _worker(rank, world, plan, options, port, notice_file=None):
    """One worker of the job, as torchrun starts it (its rank, the members' store at
    MASTER_ADDR:MASTER_PORT, hosted by worker 0), on the GPU of plan rank ``rank``; its exit
    status."""
    import torch.distributed as dist

    from megatron_autohet.elastic.worker import ElasticWorker
    from megatron_autohet.spec.cluster import load_cluster

    dist.destroy_process_group()        # run_on_ranks' group: the worker makes its own
    info = plan.ranks[rank]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(info.local_rank),
                      AUTOHET_NODE=info.node, AUTOHET_GPU=info.gpu,
                      AUTOHET_LOCAL_ADDR="127.0.0.1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="adapt-test")
    code = ElasticWorker(initial_plan=plan, template=load_cluster(CLUSTER), model=plan.model,
                         options=options, notice_file=notice_file,
                         events_jsonl=options.elastic.events_jsonl).run()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return code


def _stopped_for_good(line: str) -> int:
    """elastic/rendezvous.py's ``stop_for_good`` in a test: no agent ends the other workers
    (the standbys would wait for ever), so the worker fails the test with the line."""
    raise AssertionError(f"the job stopped for good: {line}")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_an_adapt_switch_keeps_every_member_and_loses_nothing(tmp_path, monkeypatch, capfd):
    plan = load_test_plan("tiny-two-pipelines")
    reference_options = _options(tmp_path, adapt="off",
                                 metrics_jsonl=str(tmp_path / "reference.jsonl"))
    assert run_on_ranks(4, _reference, plan, reference_options, timeout=600) == [ITERS] * 4
    reference = {r["iteration"]: r for r in _jsonl(tmp_path / "reference.jsonl")}
    capfd.readouterr()

    monkeypatch.setattr(trainer_module, "WindowMeter", InjectedWindows)
    monkeypatch.setattr(worker_module, "stop_for_good", _stopped_for_good)
    options = _elastic_options(tmp_path)
    # every member ends with the job: the two a100 standbys too
    assert run_on_ranks(4, _worker, plan, options, free_port(), timeout=600) == [0] * 4
    events = _jsonl(tmp_path / "events.jsonl")
    names = [e["event"] for e in events]
    switching = [e for e in events if e["event"] == "adapt" and e["switch"]]
    assert len(switching) == 1, events
    plans = [e for e in events if e["event"] == "plan"]
    assert [p["decision"] for p in plans] == ["kept the initial plan", "adapted in-process"]
    adapted = plans[1]
    (saved,) = [e for e in events if e["event"] == "saved"]
    at = saved["iteration"]             # the switch's iteration: a window's end
    assert at % WINDOW == 0 and at < ITERS
    # the same members (all four GPUs), two of them idle in the new plan, no new round
    assert adapted["nodes"] == ["a100", "h20", "h800"] and adapted["world_size"] == 2
    assert adapted["idle"] == ["a100:0", "a100:1"] and adapted["warm"] is True
    assert adapted["restart"] == 0
    # the decision, the save, a100's files to the training nodes, the new plan's recovery of
    # that very iteration, reported by the new plan's rank 0, and the job's end
    assert names.index("adapt") < names.index("saved") < names.index("handover") \
        < names.index("recovery"), names
    (handover,) = [e for e in events if e["event"] == "handover"]
    assert handover["idle_nodes"] == ["a100"] and handover["bytes"] > 0
    (recovery,) = [e for e in events if e["event"] == "recovery"]
    assert recovery["iteration"] == at and recovery["reported_by"] == "h800"
    first = [e for e in events if e["event"] == "first_iteration"]
    assert [e["iteration"] for e in first] == [1, at + 1]
    print(f"switch after iteration {at}: saved {saved['seconds']} s after the stop, "
          f"{handover['bytes'] / 2**20:.1f} MiB handed over in {handover['seconds']} s, "
          f"recovery {recovery['seconds']}, iteration {at + 1} done {first[1]['seconds']} s "
          "after the handover")
    assert [e["iteration"] for e in events if e["event"] == "finished"] == [ITERS]
    # the switch is timed on the new plan's rank 0, and the decisions after it (held: the
    # windows after a switch) price a switch's fixed part at what it took, not the 30 s guess
    decided = [e for e in events if e["event"] == "adapt"]
    assert [e["switch_overhead_measured_at"] for e in decided] == [None] + [at] * (
        len(decided) - 1) and len(decided) >= 2, decided
    timed = [line for line in capfd.readouterr().out.splitlines()
             if f"adapt: switched plans after iteration {at}:" in line]
    assert len(timed) == 1, timed
    priced = float(timed[0].rsplit("later switches priced at ", 1)[1].split()[0])
    assert decided[1]["switch_overhead_s"] == pytest.approx(priced, abs=0.01)
    # the switch's step saved under the old plan (a100's disk too), the end under the new one
    assert committed_steps(tmp_path / "ckpt-a100") == [at]
    assert committed_steps(tmp_path / "ckpt-h800") == [at, ITERS]

    records = _jsonl(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert all(r["consumed_samples"] == 8 * r["iteration"] for r in records)
    diffs = {r["iteration"]: max(_rel(r[key], reference[r["iteration"]][key])
                                 for key in ("lm_loss", "grad_norm")) for r in records}
    print(f"switch after iteration {at}; relative differences by iteration: {diffs}")
    assert all(diffs[i] == 0 for i in range(1, at + 1)), diffs
    assert max(diffs.values()) <= REL, diffs


def test_a_fleet_change_at_the_switch_wins(tmp_path, monkeypatch):
    """h800 gets a preemption notice at the very iteration a switch is agreed (written when the
    agreement returns, read by the stop check right after it): the job stops for the notice,
    h800 leaves, a100 re-plans in-process for itself and recovers that iteration; the switch,
    priced for the fleet that changed, is dropped. Taking the switch instead fails it."""
    from megatron_autohet.elastic.notices import Notice, write_notice
    from megatron_autohet.plan_switch import _PlanSwitch

    agree = _PlanSwitch._agree

    def agree_then_notice(self, iteration, group):
        agreed = agree(self, iteration, group)
        if agreed and os.environ["AUTOHET_NODE"] == "h800":
            write_notice(tmp_path / "notice-h800.json",
                         Notice("aws", "preempt", None, 1.0, {}))
        return agreed

    monkeypatch.setattr(trainer_module, "WindowMeter", InjectedWindows)
    monkeypatch.setattr(_PlanSwitch, "_agree", agree_then_notice)
    monkeypatch.setattr(worker_module, "stop_for_good", _stopped_for_good)
    plan = two_ranks()
    options = _elastic_options(tmp_path)
    # a100 trains to the end; h800 leaves (status 0: its agent waits for the machine to go)
    assert run_on_ranks(2, _worker, plan, options, free_port(),
                        notice_file=str(tmp_path / "notice-{node}.json"), timeout=600) == [0, 0]
    events = _jsonl(tmp_path / "events.jsonl")
    switching = [e for e in events if e["event"] == "adapt" and e["switch"]]
    assert len(switching) == 1, events
    (stop,) = [e for e in events if e["event"] == "stop"]
    assert stop["reason"] == "notice" and stop["leaving"] == ["h800"]
    plans = [e for e in events if e["event"] == "plan"]
    assert [(p["decision"], p["nodes"]) for p in plans] == [
        ("kept the initial plan", ["a100", "h800"]), ("re-planned in-process", ["a100"])]
    (recovery,) = [e for e in events if e["event"] == "recovery"]
    assert recovery["iteration"] == stop["iteration"]
    records = _jsonl(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
