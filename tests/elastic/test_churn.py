"""Spot churn on small emulated fleets, each event at a known iteration
(megatron_autohet/elastic/hold.py):

* the plan's rank 0 gets a preemption notice: every step of what follows is in events.jsonl -
  the leaving node still writes its stop, save and evacuation, the node that stays writes the
  in-process re-plan (the old rank 0, which wrote the job's events until then, is gone);
* a standby node (the job is full: ``--nnodes 1:1``) ends with status 0 when the job is over;
* every worker of every round is a fork of its node's warm fork server, and a node joining
  restarts the job on warm forks without losing an iteration.
"""

from __future__ import annotations

import pickle
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from helpers.fleets import fleet_of, make_plan
from megatron_autohet.elastic.hold import HOLD_FILE_ENV, hold_after
from megatron_autohet.testing.emulate import EmulatedFleet, _children

pytestmark = pytest.mark.e2e

def test_rank_0_leaving_after_a_notice_leaves_no_hole_in_the_events(tmp_path, monkeypatch):
    iters, save, notice_at = 8, 4, 5
    gpus = {"node0": "A100-80GB", "node2": "H800"}
    hold = tmp_path / "hold"
    hold_after(hold, notice_at)
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    fleet = fleet_of(tmp_path, make_plan(tmp_path), iters, save)
    with fleet:
        for node, gpu in gpus.items():
            fleet.add(node, gpu)
        fleet.wait_for(lambda: fleet.iteration() >= notice_at, timeout=600,
                       what=f"iteration {notice_at}")
        first = fleet.events("first_iteration")
        assert [e["iteration"] for e in first] == [1], first
        rank0 = first[0]["reported_by"]                     # who has written the events
        staying = next(n for n in gpus if n != rank0)
        fleet.nodes[rank0].watcher.send_signal(signal.SIGTERM)       # its notice
        fleet.wait_for(lambda: fleet.notice_file(rank0).exists(), timeout=60,
                       what=f"{rank0}'s notice file")
        hold_after(hold, None)
        assert fleet.reclaim_when_left(rank0, deadline_s=120)
        codes = fleet.wait_all(timeout=300)

    assert codes == {staying: 0}
    events = fleet.events()
    after = events[next(i for i, e in enumerate(events) if e["event"] == "stop"):]
    assert [(e["event"], e["reported_by"]) for e in after] == [
        ("stop", rank0), ("saved", rank0), ("evacuate", rank0),
        ("fleet", staying), ("plan", staying), ("recovery", staying),
        ("first_iteration", staying), ("finished", staying)], after
    stop, _, _, fleet_event, plan, recovery, _, finished = after
    assert stop["leaving"] == [rank0] and stop["iteration"] == notice_at
    assert fleet_event["gone"] == [rank0] and list(fleet_event["nodes"]) == [staying]
    assert plan["warm"] is True and plan["nodes"] == [staying]
    assert recovery["iteration"] == notice_at and finished["iteration"] == iters


def _rendezvous_state(port: int, run_id: str):
    """torchrun's c10d rendezvous state of ``run_id`` as the agents share it in the store."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    found = C10dRendezvousBackend(store, run_id).get_state()
    return pickle.loads(found[0]) if found else None


def test_a_standby_node_ends_with_status_0_when_the_job_is_over(tmp_path, monkeypatch):
    """The job takes one node (--nnodes 1:1); a second node waits in the rendezvous (torchrun's
    redundancy list: not admitted while the job is full). When the job finishes, its agent finds
    the rendezvous closed: the job's end, status 0 (torchrun's agent returns no result for it,
    and `autohet node` failed with status 1)."""
    hold = tmp_path / "hold"
    hold_after(hold, 2)
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    fleet = fleet_of(tmp_path, make_plan(tmp_path), 4, 2, nnodes="1:1")
    with fleet:
        fleet.add("node0", "A100-80GB")
        fleet.wait_for(lambda: fleet.iteration() >= 2, timeout=600, what="iteration 2")
        fleet.add("node2", "H800")                  # the second address: 127.0.0.2

        def standing_by():
            state = _rendezvous_state(fleet.port, fleet.job_id)
            return state is not None and any(n.addr == "127.0.0.2"
                                             for n in state.redundancy_list)
        fleet.wait_for(standing_by, timeout=600, what="node2 waiting in the rendezvous")
        hold_after(hold, None)
        codes = fleet.wait_all(timeout=300)
        log = fleet.workdir.joinpath("node2.log").read_text()
    assert codes == {"node0": 0, "node2": 0}, log[-3000:]
    assert "node2: the job's rendezvous is closed: the job has ended" in log
    assert [e["iteration"] for e in fleet.events("finished")] == [4]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def training_processes(fleet: EmulatedFleet) -> dict[str, tuple[int, list[int]]]:
    """Per node: (its warm fork server's pid, the server's children: the workers it forked)."""
    tree = _children()
    found = {}
    for name, node in fleet.nodes.items():
        servers = [p for p in tree.get(node.process.pid, []) if "--serve" in _cmdline(p)]
        assert len(servers) == 1, (name, [_cmdline(p) for p in tree.get(node.process.pid, [])])
        found[name] = (servers[0], tree.get(servers[0], []))
    return found


def test_workers_are_forks_of_the_warm_server_before_and_after_a_join(tmp_path, monkeypatch):
    iters, save, join_at = 6, 4, 2
    hold = tmp_path / "hold"
    hold_after(hold, join_at)
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    fleet = fleet_of(tmp_path, make_plan(tmp_path), iters, save)
    with fleet:
        fleet.add("node0", "A100-80GB")
        fleet.add("node2", "H800")
        fleet.wait_for(lambda: fleet.iteration() >= join_at, timeout=600,
                       what=f"iteration {join_at}")
        before = training_processes(fleet)
        assert all(len(workers) == 1 for _, workers in before.values()), before
        # node3 joins: torchrun's SIGTERM reaches the forked workers through their clients,
        # they save the held iteration, the new round's workers are forks again
        fleet.add("node3", "H20")
        fleet.wait_for(lambda: len(fleet.events("recovery")) >= 1, timeout=600,
                       what="recovery after node3 joined")
        after = training_processes(fleet)
        assert all(len(workers) == 1 for _, workers in after.values()), after
        assert all(after[n][0] == before[n][0] and after[n][1] != before[n][1] for n in before)
        hold_after(hold, None)
        codes = fleet.wait_all(timeout=600)
    assert codes == {"node0": 0, "node2": 0, "node3": 0}
    stop, recovery = fleet.events("stop")[-1], fleet.events("recovery")[-1]
    assert stop["reason"] == "signal" and stop["iteration"] == recovery["iteration"] == join_at
    assert sorted(fleet.events("plan")[-1]["nodes"]) == ["node0", "node2", "node3"]
    assert [e["iteration"] for e in fleet.events("finished")] == [iters]
