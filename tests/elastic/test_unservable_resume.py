"""A node lost without notice in a job without an S3 tier: the step's files it held exist on no
other disk, and no step the fleet that trains on (the survivor and a fresh node that joins,
the job's minimum being two) can serve is left. Every round after the loss
raises the same resume error, so the job stops for good (exit 76, the error in one line) instead
of torchrun's agents restarting the workers for ever (each with status 2, as they did)."""

from __future__ import annotations

import time

import pytest

from helpers.fleets import FAST_LOSS_TIMEOUT_S, fleet_of, make_plan
from megatron_autohet.elastic.hold import HOLD_FILE_ENV, hold_after
from megatron_autohet.elastic.rendezvous import EXIT_STOPPED

pytestmark = pytest.mark.e2e


def test_a_resume_no_step_can_serve_stops_the_elastic_job_for_good(tmp_path, monkeypatch):
    iters, save, held = 8, 2, 3
    hold = tmp_path / "hold"
    hold_after(hold, held)
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    fleet = fleet_of(tmp_path, make_plan(tmp_path), iters, save,
                     loss_timeout=FAST_LOSS_TIMEOUT_S)
    with fleet:
        fleet.add("node0", "A100-80GB")
        fleet.add("node2", "H800")
        fleet.wait_for(lambda: fleet.iteration() >= held
                       and len(fleet.events("plan")[-1]["nodes"]) == 2, timeout=600,
                       what=f"two nodes held after iteration {held}")
        fleet.kill("node2")
        hold_after(hold, None)
        fleet.add("node3", "H20")                       # a replacement, its disk empty
        deadline = time.monotonic() + 300               # a safety net, not a measurement
        while (any(n.process.poll() is None for n in fleet.nodes.values())
               and time.monotonic() < deadline):
            time.sleep(0.2)
        codes = fleet.wait_all(timeout=60)
        logs = {n: (fleet.workdir / f"{n}.log").read_text() for n in codes}
    assert codes == {"node0": EXIT_STOPPED, "node3": EXIT_STOPPED}, \
        {n: log[-3000:] for n, log in logs.items()}
    for node, log in logs.items():
        said = [line for line in log.splitlines()
                if line.startswith(f"autohet node: {node}: the job stopped for good: ")]
        assert len(said) == 1, log[-3000:]
    assert fleet.events("finished") == []
