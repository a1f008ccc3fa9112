"""Preemption traces (``ms,add|remove,node``): parsing, validation with line numbers, and the
fleet over time of the bundled synthetic trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.elastic.trace import TraceEvent, fleet_over_time, load_trace
from megatron_autohet.errors import ConfigError

SYNTHETIC = Path(__file__).resolve().parent.parent / "configs" / "traces" / "synthetic-4node.csv"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_synthetic_trace():
    events = load_trace(SYNTHETIC)
    assert events == [TraceEvent(0, "add", f"node{i}") for i in range(4)] + [
        TraceEvent(20000, "remove", "node2"), TraceEvent(40000, "add", "node4"),
        TraceEvent(60000, "remove", "node1")]
    assert fleet_over_time(events) == [
        (0, ("node0", "node1", "node2", "node3")),
        (20000, ("node0", "node1", "node3")),
        (40000, ("node0", "node1", "node3", "node4")),
        (60000, ("node0", "node3", "node4"))]


def test_comments_blank_lines_header_and_order(tmp_path):
    path = write(tmp_path, "# a trace\n\nms, action, node\n"
                           "5000,remove,n1   # preempted\n0,add,n0\n0,add,n1\n\n7000,add,n2\n")
    assert load_trace(path) == [TraceEvent(0, "add", "n0"), TraceEvent(0, "add", "n1"),
                                TraceEvent(5000, "remove", "n1"), TraceEvent(7000, "add", "n2")]


def test_initial_fleet(tmp_path):
    path = write(tmp_path, "100,remove,a\n200,add,c\n")
    events = load_trace(path, initial=["a", "b"])
    assert fleet_over_time(events, initial=["a", "b"]) == [(100, ("b",)), (200, ("b", "c"))]
    with pytest.raises(ConfigError, match="line 1"):
        load_trace(path)                             # 'a' is not up without the initial fleet
    with pytest.raises(ValueError, match="remove a, which is not up"):
        fleet_over_time(events)


def test_simultaneous_events_are_one_change():
    events = [TraceEvent(0, "add", "a"), TraceEvent(10, "remove", "a"), TraceEvent(10, "add", "b")]
    assert fleet_over_time(events) == [(0, ("a",)), (10, ("b",))]


@pytest.mark.parametrize("text, field, message", [
    ("0,add,n0\n1000,add\n", "line 2", "'1000,add' has 2 field(s)"),
    ("0,add,n0\n# c\n-5,add,n1\n", "line 3", "time '-5'"),
    ("0,add,n0\n1.5,add,n1\n", "line 2", "time '1.5'"),
    ("0,add,n0\n10,kill,n0\n", "line 2", "action 'kill' (allowed: add, remove)"),
    ("0,add,n 0\n", "line 1", "node 'n 0'"),
    ("0,add,\n", "line 1", "node ''"),
    ("x,add,n0\n", "line 1", "time 'x'"),            # not taken for a header: it has an action
    ("ms,action,node\n0,add,n0\n10,add,n0\n", "line 3", "10 ms: add n0, which is already up"),
    ("0,add,n0\n\n10,remove,n1\n", "line 3", "10 ms: remove n1, which is not up"),
    ("20,remove,n0\n10,add,n0\n30,remove,n0\n", "line 3", "30 ms: remove n0, which is not up"),
], ids=["fields", "negative", "float", "action", "space", "empty-node", "bad-first-line",
        "add-twice", "remove-absent", "checked-in-time-order"])
def test_bad_lines(tmp_path, text, field, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}: field '{field}': {message}")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_trace(tmp_path / "none.csv")


def test_elastic_package_is_torch_free():
    code = ("import sys, megatron_autohet.elastic.notices, megatron_autohet.elastic.trace; "
            "print(sorted(m for m in ('torch', 'megatron', 'boto3') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SYNTHETIC.parents[2])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
