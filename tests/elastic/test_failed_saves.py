"""An elastic job whose checkpoint saves fail stops for good, on every node.

torchrun's agents restart their workers whatever status they exit with: a worker that stopped
the job because its saves failed (exit 1) was started again in a new round, which found no step,
trained from scratch and failed its saves again - until the agents' restarts (1000) ran out.
Here every node's first two saves find their ``iter_N.partial`` taken by a plain file, so they
fail; the second in a row (--autohet-max-failed-saves 2) must end every node's `autohet node`
with status 76 and the one line saying why and which steps are complete where, after one round
only. (A checkpoint directory that is a plain file is refused before training: the writer lease
cannot be written there.)
"""

from __future__ import annotations

import time

import pytest

from helpers.fleets import fleet_of, make_plan
from megatron_autohet.elastic.rendezvous import EXIT_STOPPED

pytestmark = pytest.mark.e2e

GPUS = {"node0": "A100-80GB", "node2": "H800"}


def test_failed_saves_stop_the_elastic_job_on_every_node_for_good(tmp_path):
    fleet = fleet_of(tmp_path, make_plan(tmp_path), 8, 2)
    fleet.train_args += ["--autohet-max-failed-saves", "2"]
    for node in GPUS:     # each save's iter_N.partial in --autohet-local-ckpt-dir: a file
        (fleet.workdir / node / "ckpt").mkdir(parents=True)
        for iteration in (2, 4):
            (fleet.workdir / node / "ckpt" / f"iter_{iteration:07d}.partial").write_text("x\n")
    with fleet:
        for node, gpu in GPUS.items():
            fleet.add(node, gpu)

        def over() -> bool:         # every agent ended, or the job restarted (a second round)
            return (all(n.process.poll() is not None for n in fleet.nodes.values())
                    or len(fleet.events("first_iteration")) > 1)
        deadline = time.monotonic() + 600           # a safety net, not a measurement
        while not over() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [e["iteration"] for e in fleet.events("first_iteration")] == [1], \
            "\n".join(fleet.tail(n) for n in GPUS)                      # never restarted
        codes = fleet.wait_all(timeout=60)
    logs = {node: (fleet.workdir / f"{node}.log").read_text() for node in GPUS}
    assert codes == dict.fromkeys(GPUS, EXIT_STOPPED), "\n".join(fleet.tail(n) for n in GPUS)
    lines = {node: [line for line in log.splitlines()
                    if line.startswith(f"autohet node: {node}: the job stopped for good: ")]
             for node, log in logs.items()}
    for node, said in lines.items():
        assert len(said) == 1, logs[node][-3000:]
        assert "checkpoint of iteration 4 failed: " in said[0], said[0]
        assert "2 saves in a row failed (--autohet-max-failed-saves 2)" in said[0], said[0]
        assert "No complete step in " in said[0], said[0]
    assert [m["iteration"] for m in fleet.metrics()] == [1, 2, 3, 4]
