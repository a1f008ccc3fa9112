"""A new round whose fleet has no plan ends the elastic job on every node with one line (issue
22): a bf16 job whose two nodes are V100s (no bf16) - torchrun's rank 0 re-plans, finds none,
says why, the other worker learns it from the store at once, and both agents end with status 76
and the line instead of torchrun restarting workers that fail the same way."""

from __future__ import annotations

import pytest

from helpers.fleets import CLUSTER, fleet_of, make_plan
from megatron_autohet.elastic.rendezvous import EXIT_STOPPED

# two emulated nodes under torchrun's agents
pytestmark = pytest.mark.e2e

NODES = ("v100a", "v100b")


def test_a_fleet_with_no_plan_stops_the_job_on_every_node_with_its_line(tmp_path):
    cluster = tmp_path / "spot-4-v100.yaml"         # spot-4 and two V100 nodes
    cluster.write_text(CLUSTER.read_text() + "".join(
        f"  - {{name: {node}, gpu: V100-32GB, gpus: 1}}\n" for node in NODES))
    fleet = fleet_of(tmp_path, make_plan(tmp_path), 4, 2)
    fleet.train_args[fleet.train_args.index(str(CLUSTER))] = str(cluster)
    fleet.train_args.append("--bf16")
    with fleet:
        for node in NODES:
            fleet.add(node, "V100-32GB")
        codes = fleet.wait_all(timeout=600)      # a safety net: without the stop, restarts
    tails = "\n".join(fleet.tail(n) for n in NODES)
    assert codes == dict.fromkeys(NODES, EXIT_STOPPED), tails
    why = ("no plan for the fleet present, v100a (1 x V100-32GB), v100b (1 x V100-32GB): "
           "<fleet>: ")
    for node in NODES:
        said = [line for line in (fleet.workdir / f"{node}.log").read_text().splitlines()
                if line.startswith(f"autohet node: {node}: the job stopped for good: ")]
        assert len(said) == 1 and why in said[0] and "bf16" in said[0], tails
    (no_plan,) = fleet.events("no_plan")         # the re-planning rank's, once
    assert sorted(no_plan["nodes"]) == list(NODES) and "bf16" in no_plan["error"]
    assert fleet.events("first_iteration") == []
