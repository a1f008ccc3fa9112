"""A node lost without notice while the others wait for it in a collective:
its network cut - here its processes frozen (SIGSTOP), so its connections stay open and no
collective fails. The survivors' agents see its keep-alive lapse for the loss timeout (5 s
here), end their workers and train on in the next round from the newest checkpoint; torchrun's
agents alone would wait for the process group's timeout (30 minutes here). The event lands at a
known iteration (megatron_autohet/elastic/hold.py); the job has an S3 tier, as a job that can
lose a node without notice needs (the lost node's files of a step may be on no other disk)."""

from __future__ import annotations

import os
import signal

import pytest

from helpers.fleets import FAST_LOSS_TIMEOUT_S, fleet_of, make_plan
from megatron_autohet.elastic.hold import HOLD_FILE_ENV, hold_after
from megatron_autohet.testing.emulate import process_tree

pytestmark = pytest.mark.e2e


def test_a_node_cut_off_mid_collective_costs_at_most_the_save_interval(tmp_path, monkeypatch,
                                                                       s3_endpoint, s3_uri):
    iters, save, held = 12, 3, 6
    hold = tmp_path / "hold"
    hold_after(hold, 2)
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    fleet = fleet_of(tmp_path, make_plan(tmp_path), iters, save,
                     loss_timeout=FAST_LOSS_TIMEOUT_S)
    fleet.train_args += ["--distributed-timeout-minutes", "30",
                         # what only the lost node held comes from S3
                         "--autohet-s3-uri", s3_uri, "--autohet-s3-endpoint-url", s3_endpoint[0]]
    with fleet:
        # Two nodes make the first round (--nnodes 2:8), a third joins it at iteration 2: three
        # nodes train when the job is held after iteration 6.
        fleet.add("node0", "A100-80GB")
        fleet.add("node2", "H800")
        fleet.wait_for(lambda: fleet.iteration() >= 2, timeout=600, what="iteration 2")
        fleet.add("node3", "H20")
        fleet.wait_for(lambda: fleet.events("stop"), timeout=600, what="the join's stop")
        hold_after(hold, held)                  # every worker is past the hold at 2 by now
        fleet.wait_for(lambda: fleet.iteration() >= held and
                       len(fleet.events("plan")[-1]["nodes"]) == 3, timeout=600,
                       what=f"three nodes held after iteration {held}")
        frozen = process_tree(fleet.nodes["node2"].process.pid)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        hold_after(hold, None)                  # the others' stop check waits for node2's
        fleet.wait_for(lambda: fleet.events("finished"), timeout=600, what="the job's end")
        fleet.kill("node2")
        codes = fleet.wait_all(timeout=300)
        logs = {n: fleet.workdir.joinpath(f"{n}.log").read_text() for n in codes}

    assert codes == {"node0": 0, "node3": 0}, {n: log[-3000:] for n, log in logs.items()}
    # Nothing failed (node2 is frozen, not dead): the restart came from an agent that saw node2's
    # keep-alive lapse (the other survivor may restart first because its peers' workers died).
    assert any("lost without notice (127.0.0.2_" in log for log in logs.values()), logs
    plans = fleet.events("plan")
    assert [p["nodes"] for p in plans[-2:]] == [["node0", "node2", "node3"],
                                                 ["node0", "node3"]], plans
    recovered = fleet.events("recovery")[-1]["iteration"]
    assert held - save <= recovered <= held            # lost: at most the save interval
    assert fleet.events("finished")[0]["iteration"] == iters
