"""A node that gets no CPU for a while is busy, not lost: its whole process
tree (agent, warm fork server, workers) is frozen with SIGSTOP for 8 s, beyond the 3 s after
which the agents used to declare a member lost (its keep-alive expired in torch's rendezvous
state, on one reading) - the job had started a new round and lost up to a save interval, and the
frozen agent, back, found its own keep-alive expired and counted itself lost too. With the
default loss timeout (20 s, elastic/liveness.py) the node stays a member: no loss, no new round,
the job trains to its end on its first plan. A node frozen beyond the loss timeout is lost
(tests/elastic/test_loss.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from helpers.fleets import fleet_of, make_plan
from megatron_autohet.elastic.hold import HOLD_FILE_ENV, hold_after
from megatron_autohet.elastic.liveness import DEFAULT_LOSS_TIMEOUT_S
from megatron_autohet.testing.emulate import process_tree

pytestmark = pytest.mark.e2e

FROZEN_S = 8.0          # > the old 3 s, well below the default loss timeout


def test_a_node_frozen_for_less_than_the_loss_timeout_is_not_lost(tmp_path, monkeypatch):
    assert FROZEN_S < DEFAULT_LOSS_TIMEOUT_S / 2
    iters, save, held = 6, 3, 2
    hold = tmp_path / "hold"
    hold_after(hold, held)
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    fleet = fleet_of(tmp_path, make_plan(tmp_path), iters, save)    # the node's default
    with fleet:
        fleet.add("node0", "A100-80GB")
        fleet.add("node2", "H800")
        fleet.wait_for(lambda: fleet.iteration() >= held and fleet.events("plan") and
                       len(fleet.events("plan")[-1]["nodes"]) == 2, timeout=600,
                       what=f"two nodes held after iteration {held}")
        frozen = process_tree(fleet.nodes["node2"].process.pid)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(FROZEN_S)                    # the freeze's length, not a measurement
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        hold_after(hold, None)
        codes = fleet.wait_all(timeout=600)
        logs = {n: fleet.workdir.joinpath(f"{n}.log").read_text() for n in codes}

    assert codes == {"node0": 0, "node2": 0}, {n: log[-3000:] for n, log in logs.items()}
    assert not any("lost without notice" in log for log in logs.values()), logs
    # one round: the first plan trained every iteration, nothing was recovered or re-trained
    assert [p["nodes"] for p in fleet.events("plan")] == [["node0", "node2"]]
    assert fleet.events("recovery") == []
    assert [r["iteration"] for r in fleet.metrics()] == list(range(1, iters + 1))
    assert [e["iteration"] for e in fleet.events("finished")] == [iters]
