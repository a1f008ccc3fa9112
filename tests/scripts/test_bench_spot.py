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
    """The goodput: iterations kept per second from the first iteration to the end,
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


# ---- real traces: any node count, the join pause, a row per run, a clean end on a signal ----

def _trace_file(tmp_path, lines: list[str]) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("ms,action,node,notice\n" + "\n".join(lines) + "\n")
    return path


def test_a_trace_of_any_size_gets_its_own_nnodes_and_only_a_machine_limit_refuses(
        bench, tmp_path, monkeypatch, capsys):
    """The job's --nnodes comes from the trace (was 2:8 whatever the trace); a trace is refused
    in one line only when its largest fleet exceeds the stated per-node CPU or memory floor."""
    from megatron_autohet.testing.trace import load_trace

    lines = [f"0,add,n{i}" for i in range(4)] + [f"{1000 + i},add,n{i}" for i in range(4, 12)] \
        + [f"{5000 + i},remove,n{i}" for i in range(11)]
    path = _trace_file(tmp_path, lines)
    trace = load_trace(path)
    assert bench.fleet_bounds(trace, ["n0", "n1", "n2", "n3"]) == (1, 12, 1011)
    assert bench.capacity_problem(12, 1011, 0.1, 1.0, cores=2, mem_available_gb=20.0) is None
    line = bench.capacity_problem(12, 1011, 0.25, 1.0, cores=2, mem_available_gb=20.0)
    assert "--cpu-per-node 0.25 allows at most 8" in line and "12 nodes" in line
    line = bench.capacity_problem(12, 1011, 0.1, 2.0, cores=2, mem_available_gb=20.0)
    assert "--mem-per-node-gb 2 allows at most 10" in line
    monkeypatch.setattr(sys, "argv", ["bench_spot.py", "--trace", str(path),
                                      "--cpu-per-node", "0.25"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cpu-per-node 0.25 allows at most" in err
    monkeypatch.setattr(sys, "argv", ["bench_spot.py", "--trace", str(path),
                                      "--loss-timeout", "1"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2 and "--loss-timeout" in capsys.readouterr().err


def test_the_emulated_nodes_addresses_go_past_254_starts(tmp_path, monkeypatch):
    """Each start of a node takes a new loopback address (a replay restarts nodes, the baseline
    every node on every step): 127.0.0.N stopped at 255 starts."""
    import ipaddress

    from megatron_autohet.testing import emulate

    seen = []

    class Popen:
        def __init__(self, argv, **kwargs):
            if "--local-addr" in argv:
                seen.append(argv[argv.index("--local-addr") + 1])

    monkeypatch.setattr(emulate.subprocess, "Popen", Popen)
    fleet = emulate.EmulatedFleet(tmp_path, train_args=[], port=1)
    for i in range(300):
        fleet.add(f"node{i % 7}", "H800")
    assert seen[:2] == ["127.0.0.1", "127.0.0.2"] and len(set(seen)) == 300
    assert all(ipaddress.ip_address(a) in ipaddress.ip_network("127.0.0.0/8") for a in seen)


class _FakeTime:
    """The replay's clock: sleep() moves it on, nothing waits."""

    def __init__(self):
        import time as real
        self.now, self._real = 1000.0, real

    def time(self) -> float:
        return self.now

    monotonic = time

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):          # mktime, strptime
        return getattr(self._real, name)


class _FakeJob:
    """An elastic job on a fake fleet, driven by the fake clock: an iteration a second (none
    while the hold file holds the one just finished), a node added after the first iteration
    arrives WARMUP s later (stop after the iteration in flight, fleet, plan, first iteration 2 s
    later), a kill restarts the job 3 s later, finished at ``iters``."""
    WARMUP = 30.0

    def __init__(self, clock, workdir, *, train_args, nnodes, job_id, cold_workers,
                 loss_timeout):
        from unittest import mock
        self.clock, self.hold = clock, Path(workdir) / "hold"
        self.iters = int(train_args[train_args.index("--iters") + 1])
        self.made = dict(nnodes=nnodes, loss_timeout=loss_timeout, job_id=job_id)
        self.nodes, self.log, self.iter, self.next_at = {}, [], 0, None
        self.arrivals, self.restart_at, self.closed = {}, None, False
        self.idle: list[str] = []          # the nodes the first plan leaves idle
        self.node = lambda: mock.Mock(process=mock.Mock(poll=lambda: 0 if self.done() else None))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.closed = True
        self.nodes.clear()

    def done(self):
        return any(e["event"] == "finished" for e in self.log)

    def emit(self, event, at, **fields):
        self.log.append({"event": event, "time_unix": at, **fields})

    def tick(self):
        from megatron_autohet.elastic.hold import held_at

        now = self.clock.now
        if self.next_at is None and len(self.nodes) >= 2:
            self.next_at = now + 5.0                       # start-up
            self.emit("plan", now + 1.0, nodes=sorted(self.nodes), seconds=0.5,
                      decision="kept", idle=[f"{n}:0" for n in self.idle])
        for node, at in list(self.arrivals.items()):
            if now >= at:
                del self.arrivals[node]
                self.emit("stop", at, iteration=self.iter, reason="join")
                self.emit("fleet", at + 0.5, nodes={n: {} for n in self.nodes})
                self.emit("plan", at + 1.0, nodes=sorted(self.nodes), seconds=0.5,
                          decision="re-planned")
                self.restart_at = at + 2.0
        if self.restart_at is not None:
            if now < self.restart_at:
                return
            self.next_at, self.restart_at = self.restart_at, None
            self.emit("first_iteration", self.next_at + 1.0, iteration=self.iter + 1)
        while self.next_at is not None and now >= self.next_at + 1.0 and not self.done():
            if held_at(self.hold) == self.iter and self.iter > 0:
                break                                      # held after this iteration
            self.iter += 1
            self.next_at += 1.0
            if self.iter == 1:
                self.emit("first_iteration", self.next_at, iteration=1)
            if self.iter == self.iters:
                self.emit("finished", self.next_at, iteration=self.iter)

    def add(self, node, gpu):
        self.nodes[node] = self.node()
        if self.iter:
            self.arrivals[node] = self.clock.now + self.WARMUP

    def kill(self, node):
        self.nodes.pop(node)
        self.emit("stop", self.clock.now, iteration=self.iter, reason="loss")
        self.restart_at = self.clock.now + 3.0

    def reclaim_when_left(self, node):
        return True

    def iteration(self):
        self.tick()
        return self.iter

    def events(self, kind=None):
        self.tick()
        return [e for e in sorted(self.log, key=lambda e: e["time_unix"])
                if kind is None or e["event"] == kind]

    def metrics(self):
        return [{"iteration": i} for i in range(self.iter)]

    def tail(self, node, lines=30):
        return ""


def test_the_trace_clock_and_the_job_pause_until_a_joiner_is_in_the_job(
        bench, tmp_path, monkeypatch):
    """A synthetic trace (2 nodes, a join at 10 s, a kill at 20 s, x1) on a fake job whose
    joiner warms up 30 s: the job is held at the next iteration until the joiner's round trains
    (no iteration while it warms up), the kill comes 10 s of training after the joiner's first
    iteration, and the hold file is empty again. The fleet gets the trace's --nnodes and the
    --loss-timeout."""
    import argparse

    from megatron_autohet.elastic.hold import held_at
    from megatron_autohet.testing.trace import steps

    clock = _FakeTime()
    monkeypatch.setattr(bench, "time", clock)
    made = []

    def make_fleet(workdir, **kwargs):
        made.append(_FakeJob(clock, workdir, **kwargs))
        return made[-1]

    trace = [TraceEvent(0, "add", "node0"), TraceEvent(0, "add", "node1"),
             TraceEvent(10_000, "add", "node2"), TraceEvent(20_000, "remove", "node0",
                                                             notice=False)]
    args = argparse.Namespace(iters=60, save_interval=10, nnodes="2:3", loss_timeout=5.0,
                              clock="training", time_scale=1.0, no_notice=False,
                              cluster=bench.CLUSTER)
    run = bench.replay("autohet", tmp_path / "autohet", steps(trace), ["node0", "node1"],
                       args, ("http://s3", "b"), make_fleet=make_fleet)
    (job,) = made
    assert job.made["nnodes"] == "2:3" and job.made["loss_timeout"] == 5.0 and job.closed
    assert run["loss_timeout_s"] == 5.0 and run["nnodes"] == "2:3"
    join, kill = run["delivered"]
    stop = next(e for e in job.log if e["event"] == "stop" and e["reason"] == "join")
    assert join["held_iteration"] is not None and stop["iteration"] == join["held_iteration"]
    first = [e for e in job.log if e["event"] == "first_iteration"]
    assert join["joined_at"] == first[1]["time_unix"]
    assert kill["due"] == pytest.approx(join["joined_at"] + 10.0)
    assert held_at(tmp_path / "autohet" / "hold") is None
    assert run["finished"] is not None and not run["problems"]
    # The analysis takes the held seconds (held iteration's end to the join's stop) off the run.
    row = bench._step_row(join, job.events(), [], 1.0)
    assert row["held_s"] == pytest.approx(stop["time_unix"] - join["held_from"]) and \
        row["held_s"] > 20


def test_a_notice_to_a_node_the_plan_leaves_idle_does_not_wait_for_a_restart(
        bench, tmp_path, monkeypatch):
    """node2 is idle in the plan; its notice stops nothing (the fake job, as the real one, trains
    on with no new first iteration): the replay does not wait for one (it did, EVENT_TIMEOUT,
    then skipped the rest of the trace), the training clock runs on through the step, and the
    analysis prices it at no downtime."""
    import argparse

    from megatron_autohet.testing.trace import steps

    clock = _FakeTime()
    monkeypatch.setattr(bench, "time", clock)
    made = []

    def make_fleet(workdir, **kwargs):
        made.append(_FakeJob(clock, workdir, **kwargs))
        made[-1].idle = ["node2"]
        return made[-1]

    trace = [TraceEvent(0, "add", "node0"), TraceEvent(0, "add", "node1"),
             TraceEvent(0, "add", "node2"), TraceEvent(10_000, "remove", "node2", notice=True),
             TraceEvent(20_000, "remove", "node0", notice=False)]
    args = argparse.Namespace(iters=60, save_interval=10, nnodes="2:3", loss_timeout=5.0,
                              clock="training", time_scale=1.0, no_notice=False,
                              cluster=bench.CLUSTER)
    run = bench.replay("autohet", tmp_path / "autohet", steps(trace),
                       ["node0", "node1", "node2"], args, ("http://s3", "b"),
                       make_fleet=make_fleet)
    assert not run["problems"] and not run["skipped"]
    notice, kill = run["delivered"]
    assert notice["stops_training"] is False and kill["stops_training"] is True
    assert kill["due"] == pytest.approx(notice["t"] + 10.0)
    (job,) = made
    row = bench._step_row(notice, job.events(), [], 1.0)
    assert row["downtime_s"] == 0.0 and row["iterations_lost"] == 0 and not row["interrupted"]


def test_a_row_is_written_after_each_run(bench, tmp_path, capsys):
    import json

    out = tmp_path / "bench-spot.json"
    result = {"command": {}}

    def run_one(mode):
        if mode == "b":                      # a's row is on disk before b starts
            assert [r["mode"] for r in json.loads(out.read_text())["runs"]] == ["a"]
        return {"mode": mode, "rate": 1.0}

    assert bench.run_all(["a", "b"], run_one, result, str(out)) == 0
    written = json.loads(out.read_text())
    assert [r["mode"] for r in written["runs"]] == ["a", "b"] and written["complete"] is False
    assert result["complete"] is True


_SIGNALLED = r"""
import importlib.util, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("bench_spot", Path(sys.argv[1]) / "bench_spot.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
marker = Path(sys.argv[2])

class Fleet:
    def close(self):
        marker.write_text("closed")

def run_one(mode):
    if mode == "second":
        bench.LIVE.append(Fleet())
        print("READY", flush=True)
        time.sleep(120)
    return {"mode": mode}

sys.exit(bench.run_all(["first", "second"], run_one, {}, sys.argv[3]))
"""


@pytest.mark.parametrize("signum", [15, 2])
def test_a_signal_tears_the_fleet_down_keeps_the_rows_and_exits_128_plus_it(
        bench, tmp_path, signum):
    import json
    import os
    import subprocess

    marker, out = tmp_path / "closed", tmp_path / "out.json"
    child = subprocess.Popen([sys.executable, "-c", _SIGNALLED, str(SCRIPTS), str(marker),
                              str(out)], stdout=subprocess.PIPE, text=True)
    try:
        lines = iter(child.stdout.readline, "")
        assert "READY" in (line.strip() for line in lines)    # after "wrote ..." for the first
        os.kill(child.pid, signum)
        status = child.wait(timeout=60)
    finally:
        child.kill()
    assert status == 128 + signum and marker.read_text() == "closed"
    written = json.loads(out.read_text())
    assert [r["mode"] for r in written["runs"]] == ["first"]
    assert written["interrupted"]["signal"] == ("SIGTERM" if signum == 15 else "SIGINT")
