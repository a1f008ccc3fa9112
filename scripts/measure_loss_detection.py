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

``--soak MINUTES`` (no cases) runs one job of 4 nodes (node0-node3, ``--nnodes 1:8``) that
trains for MINUTES once all four are in its plan, then SIGKILLs node3's process tree. It counts
the false losses of the soak - "lost without notice" lines and new rounds (plans) while every
member lived - and measures, from the kill, the survivors training again. Four nodes that do
not train in one round within ASSEMBLY_TIMEOUT_S are a result too (the plans there were, the
losses declared meanwhile), not a crash. It prints a table and writes the figures, with the load
average sampled every 30 s, as JSON (``--out``)::

    python scripts/measure_loss_detection.py --loss-timeout 20 --busy 4 --soak 30
"""

from __future__ import annotations

import argparse
import json
import statistics
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

sys.path.insert(0, str(ROOT / "scripts"))

from _bench import write_json  # noqa: E402

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


SOAK_NODES = (("node0", "A100-80GB"), ("node1", "A100-80GB"), ("node2", "H800"),
              ("node3", "H20"))
SOAK_ITERS = 60000
SOAK_POLL_S = 1.0           # the soak reads events.jsonl once a second (a small load itself)
ASSEMBLY_TIMEOUT_S = 1800.0     # the four nodes' start until their first round trains
LOAD_SAMPLE_S = 30.0


def load_1min() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_soak(minutes: float, loss_timeout: float, where: Path, s3: tuple[str, str]) -> dict:
    """One job of 4 nodes trains for ``minutes``; then node3's whole tree gets SIGKILL."""
    fleet = EmulatedFleet(where / "job", nnodes="1:8", loss_timeout=loss_timeout, train_args=[
        "--plan", str(make_plan(where)), "--model", str(MODEL), "--cluster", str(CLUSTER),
        # more iterations than the soak trains (the default data cache: their sample index is
        # built once, not per soak)
        "--iters", str(SOAK_ITERS), "--save-interval", "100",
        "--autohet-s3-uri", f"s3://{s3[1]}/{uuid.uuid4().hex}", "--autohet-s3-endpoint-url",
        s3[0]])
    result: dict = {"case": "soak", "soak_minutes": minutes, "loss_timeout_s": loss_timeout,
                    "load_before": loadavg()}
    with fleet:
        for name, gpu in SOAK_NODES:
            fleet.add(name, gpu)
        names = sorted(name for name, _ in SOAK_NODES)

        def all_four_training() -> bool:
            plans = fleet.events("plan")
            return bool(plans) and plans[-1]["nodes"] == names and any(
                e["time_unix"] >= plans[-1]["time_unix"]
                for e in fleet.events("first_iteration"))
        started = time.monotonic()
        try:
            fleet.wait_for(all_four_training, timeout=ASSEMBLY_TIMEOUT_S,
                           what="four nodes training", poll=SOAK_POLL_S)
        except TimeoutError:
            # the figure itself (a fleet that never trains whole), not a crash
            result.update(assembled=False, assembly_s=None, assembly_rounds=len(
                fleet.events("plan")), assembly_plans=[p["nodes"] for p in fleet.events("plan")],
                false_losses=lost_lines(fleet), load_after=loadavg())
            return result
        result.update(assembled=True, assembly_s=round(time.monotonic() - started, 1),
                      assembly_rounds=len(fleet.events("plan")))
        plans_at_start = len(fleet.events("plan"))
        lost_at_start = lost_lines(fleet)
        iteration_at_start = fleet.iteration()
        loads = [load_1min()]
        start = time.monotonic()
        next_sample = start + LOAD_SAMPLE_S
        while time.monotonic() < start + minutes * 60:
            fleet.wait_for(lambda: time.monotonic() >= min(next_sample, start + minutes * 60),
                           timeout=LOAD_SAMPLE_S + 60, what="the soak's next sample",
                           poll=SOAK_POLL_S)
            if time.monotonic() >= next_sample:
                loads.append(load_1min())
                next_sample += LOAD_SAMPLE_S
            if fleet.events("finished"):
                raise SystemExit(f"the job trained its {SOAK_ITERS} iterations before the soak "
                                 "ended")
        plans = fleet.events("plan")
        result.update(
            soak_iterations=fleet.iteration() - iteration_at_start,
            false_losses=lost_lines(fleet) - lost_at_start,
            new_rounds=len(plans) - plans_at_start,
            new_round_nodes=[p["nodes"] for p in plans[plans_at_start:]],
            load_1min_min=min(loads), load_1min_mean=round(statistics.mean(loads), 2),
            load_1min_max=max(loads), load_1min_samples=loads)
        print(json.dumps(result), flush=True)      # the soak's figures, whatever comes next
        firsts = len(fleet.events("first_iteration"))
        killed = time.monotonic()
        fleet.kill("node3")
        again = until(lambda: len(fleet.events("first_iteration")) > firsts, 900,
                      "training again after the kill", fleet)
        result.update(
            killed="node3", training_again_s=round(again - killed, 2),
            by="keep-alive" if lost_lines(fleet) > lost_at_start + result["false_losses"]
            else "worker failure", nodes_after=fleet.events("plan")[-1]["nodes"])
    result["load_after"] = loadavg()
    return result


def soak_table(found: dict) -> str:
    if not found["assembled"]:
        return (f"| measure | result |\n|---|---|\n| four nodes in one round | not after "
                f"{ASSEMBLY_TIMEOUT_S:g} s ({found['assembly_rounds']} plans: "
                f"{found['assembly_plans']}); load {found['load_before']} / "
                f"{found['load_after']} |\n| false losses (lost without notice) | "
                f"{found['false_losses']} |")
    rows = [("four nodes in one round", f"after {found['assembly_s']} s, "
                                        f"{found['assembly_rounds']} plan(s)"),
            ("loss timeout", f"{found['loss_timeout_s']:g} s"),
            ("busy loops beside", str(found["busy_loops"])),
            ("soak", f"{found['soak_minutes']:g} min, 4 nodes, {found['soak_iterations']} "
                     "iterations"),
            ("load average (1 min) during the soak",
             f"{found['load_1min_min']} - {found['load_1min_max']}, mean "
             f"{found['load_1min_mean']}"),
            ("false losses (lost without notice)", str(found["false_losses"])),
            ("new rounds, every member alive", str(found["new_rounds"])),
            ("SIGKILL of node3's tree: training again", f"{found['training_again_s']} s "
                                                       f"(by {found['by']})")]
    return "\n".join(["| measure | result |", "|---|---|"]
                     + [f"| {a} | {b} |" for a, b in rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss-timeout", type=float, required=True)
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the fleet")
    parser.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                        help="one 4-node job for MINUTES, then a SIGKILL (no cases)")
    parser.add_argument("--out", default=str(ROOT / "bench-out" / "loss-detection-soak.json"),
                        help="the soak's JSON results (default bench-out/"
                             "loss-detection-soak.json)")
    parser.add_argument("cases", nargs="*", help="kill | freeze=SECONDS")
    args = parser.parse_args()
    if (args.soak is None) == (not args.cases):
        parser.error("give either cases (kill | freeze=SECONDS) or --soak MINUTES")
    if args.soak is not None and args.soak <= 0:
        parser.error(f"--soak: {args.soak:g} minutes; a soak needs more than 0")
    # SIGTERM ends the run as Ctrl-C does: the fleet, the S3 server and the busy loops stop
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        if args.soak is not None:
            with (tempfile.TemporaryDirectory(prefix="autohet-soak-") as where,
                  moto_s3_server() as s3):
                found = run_soak(args.soak, args.loss_timeout, Path(where), s3)
            found["busy_loops"] = args.busy
            write_json(found, args.out)
            print(soak_table(found), flush=True)
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
