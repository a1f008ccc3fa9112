"""What `autohet node --loss-timeout` costs, both ways, on a 2-node emulated fleet (docs/spot.md).

Each case starts a fleet (node0, node2; ``--nnodes 1:8``, so the survivor of a loss trains on
alone; an S3 tier, moto's server, for what only a lost node held), holds the job after iteration
3 (megatron_autohet/elastic/hold.py; saves every 2), then:

* ``kill``: the whole process tree of node2 gets SIGKILL (a machine gone) and the hold moves on;
  measured from the kill: node0 training again (its next ``first_iteration`` event), and whether
  its agent declared the loss from the keep-alives ("lost without notice") or its workers failed
  first (gloo's closed connections: the new round still waits for torch's expiry of the dead
  member, one second after the loss timeout);
* ``freeze=N``: the whole process tree of node2 (agent, fork server, workers) is frozen with
  SIGSTOP for N seconds (a node without CPU, or cut off: its connections stay open, nothing
  fails), then SIGCONT; measured from the SIGSTOP: node0's "lost without notice" line, if any
  (node0's log is polled every 0.05 s until 4 s after the SIGCONT); then the job trains to its
  end: how many such lines all nodes logged and how many plans (rounds that trained) came after
  the freeze began.

Usage (each case one fleet, about 1-2 minutes on 2 cores; one JSON line per case, with the load
average before and after)::

    python scripts/measure_loss_detection.py --loss-timeout 20 kill freeze=8 freeze=25
    python scripts/measure_loss_detection.py --loss-timeout 5 kill freeze=3 freeze=8
    python scripts/measure_loss_detection.py --loss-timeout 20 --busy 4 freeze=8

``--busy K`` runs K busy loops beside the fleet (a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_autohet.elastic.hold import HOLD_FILE_ENV, hold_after  # noqa: E402
from megatron_autohet.testing.emulate import EmulatedFleet, process_tree  # noqa: E402
from megatron_autohet.testing.s3_server import moto_s3_server  # noqa: E402

MODEL = ROOT / "configs/models/tiny.yaml"
CLUSTER = ROOT / "configs/clusters/spot-4.yaml"
LOST = re.compile(r"lost without notice")
HELD = 3


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def make_plan(where: Path) -> Path:
    plan = where / "plan.yaml"
    subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", "plan", "--cluster",
                    str(CLUSTER), "--model", str(MODEL), "--global-batch-size", "8",
                    "--micro-batch-size", "1", "-o", str(plan)], check=True,
                   capture_output=True)
    return plan


def until(predicate, timeout_s: float, what: str, fleet: EmulatedFleet, poll: float = 0.05):
    """Polls ``predicate`` every ``poll`` s; the monotonic time it first held."""
    fleet.wait_for(predicate, timeout=timeout_s, what=what, poll=poll)
    return time.monotonic()


def lost_lines(fleet: EmulatedFleet) -> int:
    return sum(len(LOST.findall(p.read_text(errors="replace")))
               for p in fleet.workdir.glob("node*.log"))


def run_case(case: str, loss_timeout: float, where: Path, s3: tuple[str, str]) -> dict:
    hold = where / "hold"
    hold_after(hold, HELD)
    os.environ[HOLD_FILE_ENV] = str(hold)
    fleet = EmulatedFleet(where / "job", nnodes="1:8", loss_timeout=loss_timeout, train_args=[
        "--plan", str(make_plan(where)), "--model", str(MODEL), "--cluster", str(CLUSTER),
        "--iters", "6", "--save-interval", "2", "--data-dir", str(where / "data"),
        # what only the killed node held comes from S3
        "--autohet-s3-uri", f"s3://{s3[1]}/{uuid.uuid4().hex}", "--autohet-s3-endpoint-url",
        s3[0]])
    result = {"case": case, "loss_timeout_s": loss_timeout, "load_before": loadavg()}
    with fleet:
        fleet.add("node0", "A100-80GB")
        fleet.add("node2", "H800")
        fleet.wait_for(lambda: fleet.iteration() >= HELD and fleet.events("plan") and
                       len(fleet.events("plan")[-1]["nodes"]) == 2, timeout=900,
                       what="two nodes held")
        time.sleep(1)                           # the workers at the hold, the save done
        log = fleet.workdir / "node0.log"
        firsts = len(fleet.events("first_iteration"))
        plans = len(fleet.events("plan"))
        start = time.monotonic()
        if case == "kill":
            fleet.kill("node2")
            hold_after(hold, None)
            again = until(lambda: len(fleet.events("first_iteration")) > firsts, 900,
                          "training again", fleet)
            result.update(training_again_s=round(again - start, 2),
                          by="keep-alive" if lost_lines(fleet) else "worker failure")
        else:
            frozen_s = float(case.split("=", 1)[1])
            pids = process_tree(fleet.nodes["node2"].process.pid)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            detected, resumed = None, None
            while resumed is None or time.monotonic() < resumed + 4:
                if resumed is None and time.monotonic() >= start + frozen_s:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
                    resumed = time.monotonic()
                if detected is None and LOST.search(log.read_text(errors="replace")):
                    detected = time.monotonic()
                time.sleep(0.05)
            hold_after(hold, None)
            fleet.wait_for(lambda: fleet.events("finished"), timeout=900, what="the end")
            result.update(frozen_s=frozen_s, detected_s=None if detected is None
                          else round(detected - start, 2), losses=lost_lines(fleet),
                          new_plans=len(fleet.events("plan")) - plans)
    result["load_after"] = loadavg()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss-timeout", type=float, required=True)
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the fleet")
    parser.add_argument("cases", nargs="+", help="kill | freeze=SECONDS")
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        for case in args.cases:
            with (tempfile.TemporaryDirectory(prefix="autohet-loss-") as where,
                  moto_s3_server() as s3):
                found = run_case(case, args.loss_timeout, Path(where), s3)
                found["busy_loops"] = args.busy
                print(json.dumps(found), flush=True)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
