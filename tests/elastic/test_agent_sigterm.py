"""SIGTERM to a node's agent (`autohet node`, not its watcher) is a preemption notice: the node
saves, hands its files on and leaves, the node that stays trains to the end in-process.

Before, torchrun's own handler took the signal: the agent exited 1, its worker trained on as an
orphan (in an in-process re-plan), and the other agents hung 300 s in torchrun's exit barrier.
"""

from __future__ import annotations

import signal
import time

import pytest

from helpers.fleets import fleet_of, make_plan
from megatron_autohet.elastic.hold import HOLD_FILE_ENV, hold_after
from megatron_autohet.elastic.notices import read_notice

pytestmark = pytest.mark.e2e

GRACE_S = 30                # autohet node's default --signal-grace


def test_sigterm_to_an_agent_is_its_nodes_preemption_notice(tmp_path, monkeypatch):
    iters, saved_at, notice_at = 6, 2, 3
    gpus = {"node0": "A100-80GB", "node2": "H800"}
    hold = tmp_path / "hold"
    hold_after(hold, notice_at)
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    with fleet_of(tmp_path, make_plan(tmp_path), iters, saved_at) as fleet:
        for node, gpu in gpus.items():
            fleet.add(node, gpu)
        fleet.wait_for(lambda: fleet.iteration() >= notice_at, timeout=600,
                       what=f"iteration {notice_at}")
        leaving = fleet.events("first_iteration")[0]["reported_by"]
        staying = next(n for n in gpus if n != leaving)
        fleet.nodes[leaving].process.send_signal(signal.SIGTERM)
        fleet.wait_for(lambda: fleet.notice_file(leaving).exists(), timeout=60,
                       what=f"{leaving}'s notice file")
        notice = read_notice(fleet.notice_file(leaving))
        hold_after(hold, None)
        left = fleet.reclaim_when_left(leaving, deadline_s=notice.deadline_unix - time.time())
        assert left, fleet.tail(leaving, 60)
        codes = fleet.wait_all(timeout=600)
        stop = fleet.events("stop")[-1]
        after_stop = [p for p in fleet.events("plan") if p["time_unix"] > stop["time_unix"]]
    assert (notice.source, notice.kind, notice.detail) == ("signal", "preempt",
                                                          {"signal": "SIGTERM"})
    assert notice.deadline_unix - notice.received_unix == pytest.approx(GRACE_S)
    assert codes == {staying: 0}
    assert fleet.iteration() == iters
    log = fleet.workdir.joinpath(f"{leaving}.log").read_text()
    assert (f"autohet node: {leaving}: SIGTERM: preemption notice from signal: SIGTERM"
            in log), log[-3000:]
    # as on its watcher's notice: a stop for the leaving node, then the plan for the node that
    # stays in-process (no restart, no rendezvous)
    assert stop["leaving"] == [leaving]
    assert after_stop and after_stop[0].get("warm") is True, after_stop
