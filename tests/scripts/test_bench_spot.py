"""scripts/bench_spot.py's bookkeeping, on hand-made event logs: what a replay does for each
trace event, and an analysis that reports what the job's files show - a missing ``plan`` event
(written by nobody when the leaving node was the plan's rank 0) or a job that never trained
again is a None, never an exception. The replay itself needs an emulated fleet for minutes:
run the script (``--quick``) for that."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from megatron_autohet.testing.trace import TraceEvent

pytestmark = pytest.mark.unit

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))            # its `_bench` helper module
    try:
        spec = importlib.util.spec_from_file_location("bench_spot", SCRIPTS / "bench_spot.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPTS))


def test_event_kind(bench):
    join, removal = TraceEvent(5, "add", "n4"), TraceEvent(5, "remove", "n1")
    assert bench.event_kind(join, "autohet", no_notice=False) == "join"
    assert bench.event_kind(removal, "autohet", no_notice=False) == "notice"   # trace is silent
    assert bench.event_kind(TraceEvent(5, "remove", "n1", notice=False), "autohet",
                            no_notice=False) == "kill"
    assert bench.event_kind(TraceEvent(5, "remove", "n1", notice=True), "autohet",
                            no_notice=True) == "kill"                       # --no-notice
    assert bench.event_kind(join, "baseline", no_notice=False) == "restart-all"


def _record(iteration: int, timestamp: str, elapsed_ms: float = 500.0) -> dict:
    return {"iteration": iteration, "timestamp": timestamp, "elapsed_ms": elapsed_ms}


def test_analysis_without_plan_event_and_without_resume(bench, tmp_path):
    import json
    import time

    t0 = time.mktime(time.strptime("2026-11-27 10:00:00", "%Y-%m-%d %H:%M:%S"))
    events = [
        {"event": "first_iteration", "time_unix": t0, "iteration": 1, "seconds": 9.0},
        # step 1 (t0 + 10): a notice on the plan's rank 0 node: stop, evacuate and recovery
        # are there, the re-plan's `plan` event is not
        {"event": "stop", "time_unix": t0 + 10.5, "iteration": 20, "reason": "notice"},
        {"event": "evacuate", "time_unix": t0 + 11.0, "bytes": 10, "seconds": 0.2},
        {"event": "recovery", "time_unix": t0 + 12.0, "iteration": 20,
         "bytes": {"own": 5, "s3": 0}, "seconds": {"discover": 0.1, "fetch": 0.4}},
        {"event": "first_iteration", "time_unix": t0 + 12.5, "iteration": 21, "seconds": 2.0},
    ]
    records = [_record(i, "2026-11-27 10:00:0%d" % min(i, 9)) for i in range(1, 21)]
    records.append(_record(21, "2026-11-27 10:00:12"))
    records += [_record(i, "2026-11-27 10:00:20") for i in range(22, 31)]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    delivered = [
        {"ms": 1000, "t": t0 + 10.0, "late_s": 0.0, "iteration_before": 19, "kind": "notice",
         "events": [{"action": "remove", "node": "node0", "kind": "notice"}]},
        # step 2 (t0 + 30): a kill after which the job never trained again (nor finished)
        {"ms": 2000, "t": t0 + 30.0, "late_s": 0.0, "iteration_before": 28, "kind": "kill",
         "events": [{"action": "remove", "node": "node3", "kind": "kill"}]},
    ]
    run = {"t_start": t0 - 10, "t0": t0, "metrics_at_t0": 1, "delivered": delivered,
           "skipped": [], "problems": [], "rounds_started": 1, "agent_exits_during_run": [],
           "agent_ends": {}, "finished": None}
    result = bench.analyse("autohet", tmp_path, run)
    notice, kill = result["events"]
    assert notice["replan_s"] is None and notice["restart_s"] is None
    assert notice["iterations_lost"] == 0 and notice["downtime_s"] == pytest.approx(1.5)
    assert not kill["resumed"] and kill["downtime_s"] is None and kill["iterations_lost"] is None
    assert result["by_kind"]["notice"]["downtime_mean_s"] == pytest.approx(1.5)
    assert result["by_kind"]["kill"]["never_resumed"] == 1 and not result["finished"]
    bench.print_run("autohet", result)               # the report prints the gaps as "-"


def test_analysis_of_a_step_that_did_not_stop_training(bench, tmp_path):
    """A node the plan left idle goes: no stop, no re-plan, training goes on - no downtime."""
    import json

    events = [{"event": "first_iteration", "time_unix": 100.0, "iteration": 1, "seconds": 9.0},
              {"event": "finished", "time_unix": 130.0, "iteration": 30}]
    records = [_record(i, "2026-11-27 10:00:00") for i in range(1, 31)]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    delivered = [{"ms": 1000, "t": 110.0, "late_s": 0.0, "iteration_before": 12,
                  "kind": "notice", "events": [{"action": "remove", "node": "node1",
                                                "kind": "notice"}]}]
    run = {"t_start": 90.0, "t0": 100.0, "metrics_at_t0": 1, "delivered": delivered,
           "skipped": [], "problems": [], "rounds_started": 1, "agent_exits_during_run": [],
           "agent_ends": {}, "finished": events[-1]}
    result = bench.analyse("autohet", tmp_path, run)
    (row,) = result["events"]
    assert not row["interrupted"] and row["downtime_s"] == 0.0 and row["iterations_lost"] == 0
    # 29 iterations kept after the first, at the median 0.5 s, in the 30 s to the end
    assert result["kept_at_median_fraction"] == pytest.approx(29 * 0.5 / 30)
    assert result["rate_iterations_per_s"] == pytest.approx(29 / 30)
    # A join that nothing followed was not admitted: not a free join.
    delivered[0].update(kind="join", events=[{"action": "add", "node": "node4", "kind": "join"}])
    result = bench.analyse("autohet", tmp_path, run)
    (row,) = result["events"]
    assert row["admitted"] is False and row["downtime_s"] is None
    assert result["by_kind"]["join"]["joins_not_admitted"] == 1


def _quiet_run(bench, tmp_path, name: str, iterations: list[int], seconds: float) -> dict:
    """The files and replay record of a run without steps: first iteration at 100, the
    iterations logged in this order (a repeated one re-trained), finished ``seconds`` later."""
    import json

    workdir = tmp_path / name
    workdir.mkdir()
    events = [{"event": "first_iteration", "time_unix": 100.0, "iteration": 1, "seconds": 9.0},
              {"event": "finished", "time_unix": 100.0 + seconds, "iteration": iterations[-1]}]
    records = [_record(i, "2026-11-27 10:00:00") for i in iterations]
    (workdir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = {"t_start": 90.0, "t0": 100.0, "metrics_at_t0": 1, "delivered": [], "skipped": [],
           "problems": [], "rounds_started": 1, "agent_exits_during_run": [],
           "agent_ends": {}, "finished": events[-1]}
    return bench.analyse(name, workdir, run)


def test_goodput_is_the_rate_against_the_no_event_run(bench, tmp_path, capsys):
    """Issue 22's goodput: iterations kept per second from the first iteration to the end,
    over the same figure of the run without events - which paid the same saves."""
    reference = _quiet_run(bench, tmp_path, "no-events", list(range(1, 31)), 15.0)
    # 18-20 re-trained after a restore: 32 logged, still 29 kept after the first, in 30 s
    run = _quiet_run(bench, tmp_path, "autohet", list(range(1, 21)) + list(range(18, 31)), 30.0)
    assert run["iterations_retrained"] == 3
    assert run["rate_iterations_per_s"] == pytest.approx(29 / 30)
    assert reference["rate_iterations_per_s"] == pytest.approx(29 / 15)
    assert bench.goodput(run, reference) == pytest.approx(0.5)
    assert bench.goodput(reference, reference) == pytest.approx(1.0)
    assert bench.goodput(run, None) is None                   # --no-reference
    for r in (run, reference):
        r["goodput"] = bench.goodput(r, reference)
    summary = bench.summarise(run, run, reference, save_interval=10)
    assert summary["autohet_goodput"] == pytest.approx(0.5)
    assert summary["no_event_rate_iterations_per_s"] == pytest.approx(29 / 15)
    assert summary["autohet_kept_at_median_fraction"] == pytest.approx(29 * 0.5 / 30)
    bench.print_run("no events", reference)
    bench.print_summary(summary)
    out = capsys.readouterr().out
    assert "goodput 100% of the no-event run's rate" in out and "| kind |" not in out
    assert "autohet 50% (0.97 it/s)" in out
    run["goodput"] = None
    bench.print_summary(bench.summarise(run, run, None, save_interval=10))
    assert "goodput (rate over the no-event run's n/a it/s): autohet n/a" in \
        capsys.readouterr().out


def test_no_reference_with_quick_is_refused_in_one_line(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_spot.py", "--quick", "--no-reference"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--no-reference" in err and "--quick" in err
