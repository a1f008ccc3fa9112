"""Preemption traces (``ms,add|remove,node[,notice|no-notice]``): parsing, validation with line
numbers, grouping of simultaneous events, the fleet over time, and the bundled traces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.testing.trace import (TraceEvent, TraceStep, fleet_over_time, load_trace,
                                            steps)
from megatron_autohet.errors import ConfigError

TRACES = Path(__file__).resolve().parents[2] / "configs" / "traces"
SYNTHETIC = TRACES / "synthetic-4node.csv"
CHURN = TRACES / "churn-4node-5h.csv"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


@pytest.mark.unit
def test_synthetic_trace():
    events = load_trace(SYNTHETIC)
    assert events == [TraceEvent(0, "add", f"node{i}") for i in range(4)] + [
        TraceEvent(20000, "remove", "node2", notice=True), TraceEvent(40000, "add", "node4"),
        TraceEvent(60000, "remove", "node1", notice=False)]
    assert fleet_over_time(events) == [
        (0, ("node0", "node1", "node2", "node3")),
        (20000, ("node0", "node1", "node3")),
        (40000, ("node0", "node1", "node3", "node4")),
        (60000, ("node0", "node3", "node4"))]


@pytest.mark.unit
def test_comments_blank_lines_header_and_order(tmp_path):
    path = write(tmp_path, "# a trace\n\nms, action, node\n"
                           "5000,remove,n1   # preempted\n0,add,n0\n0,add,n1\n\n7000,add,n2\n")
    assert load_trace(path) == [TraceEvent(0, "add", "n0"), TraceEvent(0, "add", "n1"),
                                TraceEvent(5000, "remove", "n1"), TraceEvent(7000, "add", "n2")]


@pytest.mark.unit
def test_initial_fleet(tmp_path):
    path = write(tmp_path, "100,remove,a\n200,add,c\n")
    events = load_trace(path, initial=["a", "b"])
    assert fleet_over_time(events, initial=["a", "b"]) == [(100, ("b",)), (200, ("b", "c"))]
    with pytest.raises(ConfigError, match="line 1"):
        load_trace(path)                             # 'a' is not up without the initial fleet
    with pytest.raises(ValueError, match="remove a, which is not up"):
        fleet_over_time(events)


@pytest.mark.unit
def test_simultaneous_events_are_one_change():
    events = [TraceEvent(0, "add", "a"), TraceEvent(10, "remove", "a"), TraceEvent(10, "add", "b")]
    assert fleet_over_time(events) == [(0, ("a",)), (10, ("b",))]


@pytest.mark.unit
def test_notice_column(tmp_path):
    path = write(tmp_path, "ms,action,node,notice\n0,add,a\n0,add,b,\n0,add,c\n"
                           "10,remove,a,notice\n20,remove,b,no-notice\n30,remove,c\n")
    assert load_trace(path) == [
        TraceEvent(0, "add", "a"), TraceEvent(0, "add", "b"), TraceEvent(0, "add", "c"),
        TraceEvent(10, "remove", "a", notice=True), TraceEvent(20, "remove", "b", notice=False),
        TraceEvent(30, "remove", "c", notice=None)]       # the trace does not say: a replay does


@pytest.mark.unit
def test_steps_deliver_simultaneous_events_together(tmp_path):
    path = write(tmp_path, "0,add,a\n0,add,b\n0,add,c\n5000,remove,b,notice\n"
                           "5000,remove,a,no-notice\n5001,remove,c\n9000,add,d\n")
    events = load_trace(path)
    assert steps(events) == [
        TraceStep(0, tuple(events[:3])),
        TraceStep(5000, (TraceEvent(5000, "remove", "b", True),
                         TraceEvent(5000, "remove", "a", False))),     # in the file's order
        TraceStep(5001, (TraceEvent(5001, "remove", "c"),)),         # a ms later: a step of its own
        TraceStep(9000, (TraceEvent(9000, "add", "d"),))]
    assert steps([]) == []
    assert steps(list(reversed(events)))[1].ms == 5000             # sorted by time


@pytest.mark.unit
def test_churn_trace_has_the_public_traces_churn():
    """15 joins and 15 removals (public traces: about 15 + 15 per hour per 20 nodes; here about
    19 node-hours), removals in bursts of 2-3 within a minute, 20% without notice, never fewer
    than 2 nodes (the emulated job's minimum)."""
    events = load_trace(CHURN)
    initial = [e.node for e in events if e.ms == 0]
    later = [e for e in events if e.ms > 0]
    removals = [e for e in later if e.action == "remove"]
    assert len(initial) == 4 and len(removals) == 15 and len(later) - len(removals) == 15
    assert all(e.notice is not None for e in removals)
    assert sum(not e.notice for e in removals) == 3
    timeline = fleet_over_time(events)
    node_hours = sum(len(fleet) * (end - start) for (start, fleet), (end, _) in
                     zip(timeline, timeline[1:])) / 3.6e6
    assert 15 <= 15 / node_hours * 20 <= 20                    # removals per hour per 20 nodes
    assert min(len(fleet) for _, fleet in timeline) >= 2
    bursts, last = [], None
    for e in removals:
        if last is not None and e.ms - last.ms < 60_000:
            bursts[-1].append(e)
        else:
            bursts.append([e])
        last = e
    assert {len(b) for b in bursts} == {1, 2, 3}
    assert sum(len(b) for b in bursts if len(b) > 1) >= 10     # most removals come in bursts
    assert sum(len(s.events) > 1 for s in steps(removals)) >= 3   # some at the same millisecond


@pytest.mark.unit
@pytest.mark.parametrize("text, field, message", [
    ("0,add,n0\n1000,add\n", "line 2", "'1000,add' has 2 field(s)"),
    ("0,add,n0\n9,remove,n0,notice,x\n", "line 2", "'9,remove,n0,notice,x' has 5 field(s)"),
    ("0,add,n0\n9,remove,n0,warned\n", "line 2", "notice column 'warned' (allowed: notice, "
                                                   "no-notice, or nothing)"),
    ("0,add,n0,notice\n", "line 1", "'notice' on an add"),
    ("0,add,n0\n# c\n-5,add,n1\n", "line 3", "time '-5'"),
    ("0,add,n0\n1.5,add,n1\n", "line 2", "time '1.5'"),
    ("0,add,n0\n10,kill,n0\n", "line 2", "action 'kill' (allowed: add, remove)"),
    ("0,add,n 0\n", "line 1", "node 'n 0'"),
    ("0,add,\n", "line 1", "node ''"),
    ("x,add,n0\n", "line 1", "time 'x'"),            # not taken for a header: it has an action
    ("ms,action,node\n0,add,n0\n10,add,n0\n", "line 3", "10 ms: add n0, which is already up"),
    ("0,add,n0\n\n10,remove,n1\n", "line 3", "10 ms: remove n1, which is not up"),
    ("20,remove,n0\n10,add,n0\n30,remove,n0\n", "line 3", "30 ms: remove n0, which is not up"),
], ids=["fields", "five-fields", "notice-value", "notice-on-add", "negative", "float", "action",
        "space", "empty-node", "bad-first-line",
        "add-twice", "remove-absent", "checked-in-time-order"])
def test_bad_lines(tmp_path, text, field, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}: field '{field}': {message}")


@pytest.mark.unit
def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_trace(tmp_path / "none.csv")


@pytest.mark.integration
def test_elastic_package_is_torch_free():
    code = ("import sys, megatron_autohet.elastic.notices, megatron_autohet.testing.trace; "
            "print(sorted(m for m in ('torch', 'megatron', 'boto3') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SYNTHETIC.parents[2])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
