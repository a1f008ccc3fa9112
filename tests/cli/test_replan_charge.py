"""`autohet replan` prices the new plan the way the previous one was priced: the charge comes
from the plan file (``predicted.charge``), not from a flag, since the elastic agents re-plan
without the flags `autohet plan` had."""

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.plan import load_plan

pytestmark = pytest.mark.integration

FLEET = ("name: priced-4\ninter_node_bandwidth_gbs: 25\nnodes:\n"
         "  - {name: a100, gpu: A100-80GB, gpus: 2, spot_price: 1.6}\n"
         "  - {name: h800, gpu: H800, gpus: 1, spot_price: 2.9}\n")


@pytest.mark.parametrize("charge", ["per-gpu", "per-node"])
def test_a_replan_keeps_the_plans_charge(capsys, tmp_path, charge):
    before, after = tmp_path / "before.yaml", tmp_path / "after.yaml"
    before.write_text(FLEET + "  - {name: h20, gpu: H20, gpus: 1, spot_price: 1.2}\n")
    after.write_text(FLEET)
    plan = tmp_path / "plan.yaml"
    assert main(["plan", "--cluster", str(before), "--model", "configs/models/tiny.yaml",
                 "--global-batch-size", "8", "--micro-batch-size", "2", "--charge", charge,
                 "-o", str(plan)]) == 0
    assert load_plan(plan).predicted["charge"] == charge
    capsys.readouterr()
    new = tmp_path / "new.yaml"
    assert main(["replan", "--plan", str(plan), "--cluster", str(after), "--model",
                 "configs/models/tiny.yaml", "-o", str(new)]) == 0
    out = capsys.readouterr().out
    assert load_plan(new).predicted["charge"] == charge
    assert f"--charge {charge})" in out
