#!/usr/bin/env python
"""kill -9 of a whole `autohet train` process tree at random moments around its saves, then the
same command again: does it resume exactly where the killed job's last reported save says?

Each kill runs the job (tiny-two-pipelines, 4 ranks on this machine) with ``--load`` naming its
own checkpoints, waits for a random iteration and a random fraction of an iteration more (so
kills land before, inside and after saves), and SIGKILLs the launcher and every rank at once.
The same command then runs to the end, and the kill is:

* ``exact``: it resumed from the last save the killed job reported ("successfully saved ...
  from iteration N"), or from a newer one it committed but had no time to report;
* ``wrong``: it resumed from an older step than one reported saved (a save lost), or its losses
  after the resume differ in any bit from one uninterrupted run's (the same plan: identical);
* ``refused``: the restart was refused (the killed job's writer lease was not seen dead).

The modes rotate: synchronous and ``--async-save`` saves, to ``--save`` (one directory) or to
node-local directories with an S3 tier (moto's server, here).

    .venv/bin/python scripts/bench_kills.py --kills 20

prints a row per kill as it ends and a summary, and writes bench-out/bench_kills.json (after
every kill: a stopped run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import write_json
from megatron_autohet.testing.emulate import kill_tree
from megatron_autohet.testing.s3_server import moto_s3_server

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"
MODES = ("sync", "async", "sync+local+s3", "async+local+s3")
SAVED = re.compile(r"successfully saved checkpoint from iteration\s+(\d+)")
LOADED = re.compile(r"successfully loaded checkpoint: recovered iteration (\d+)")


def command(mode: str, work: Path, iters: int, interval: int, s3: tuple[str, str] | None,
            prefix: str) -> list[str]:
    args = [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan", str(PLAN),
            "--model", str(MODEL), "--iters", str(iters), "--save-interval", str(interval),
            "--data-dir", str(work.parent / "data"), "--metrics-jsonl", str(work / "m.jsonl")]
    if "local" in mode:
        local = str(work / "local" / "{node}")
        args += ["--autohet-local-ckpt-dir", local, "--load", local]
    else:
        args += ["--save", str(work / "ckpt"), "--load", str(work / "ckpt")]
    if "async" in mode:
        args.append("--async-save")
    if "s3" in mode:
        args += ["--autohet-s3-uri", f"s3://{s3[1]}/{prefix}", "--autohet-s3-endpoint-url",
                 s3[0]]
    return args


def losses(path: Path) -> dict[int, float]:
    found = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        found[record["iteration"]] = record["lm_loss"]
    return found


def one_kill(k: int, mode: str, work: Path, args, rng: random.Random, reference: dict,
             timeout: float) -> dict:
    work.mkdir(parents=True)
    cmd = command(mode, work, args.iters, args.save_interval, args.s3, f"kill-{k}")
    target = rng.randint(1, args.iters - 1)
    extra = rng.uniform(0.0, 1.0)
    log = open(work / "killed.log", "w")
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    started = time.monotonic()
    try:
        while len(losses(work / "m.jsonl")) < target and job.poll() is None:
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"kill {k}: iteration {target} not reached in {timeout} s")
            time.sleep(0.01)
        time.sleep(extra * args.iteration_s)
        kill_tree(job.pid)
    finally:
        job.wait()
        log.close()
    killed_out = (work / "killed.log").read_text()
    reported = [int(n) for n in SAVED.findall(killed_out)]
    trained_before = max(losses(work / "m.jsonl"), default=0)
    (work / "m.jsonl").unlink(missing_ok=True)
    t = time.monotonic()
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    restart_s = time.monotonic() - t
    loaded = LOADED.search(resumed.stdout)
    start = int(loaded.group(1)) if loaded else 0
    after = losses(work / "m.jsonl")
    last_reported = max(reported, default=0)
    if resumed.returncode == 2 and "being written by a live job" in resumed.stderr:
        verdict = "refused"
    elif resumed.returncode != 0:
        verdict = f"failed ({resumed.returncode})"
    elif start < last_reported:
        verdict = "wrong"
    elif any(after.get(i) != reference[i] for i in range(start + 1, args.iters + 1)):
        verdict = "wrong"
    else:
        verdict = "exact"
    return {"kill": k, "mode": mode, "killed_at_iteration": target,
            "trained_before": trained_before,
            "last_reported_save": last_reported, "resumed_from": start,
            "verdict": verdict, "restart_s": round(restart_s, 1),
            "stderr_tail": resumed.stderr[-500:] if verdict != "exact" else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--save-interval", type=int, default=2)
    parser.add_argument("--iteration-s", type=float, default=0.5,
                        help="about one iteration's time here: the kill lands up to this much "
                             "after the chosen iteration's end")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, rotated over the kills (of {', '.join(MODES)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    parser.add_argument("--json", default=str(ROOT / "bench-out" / "bench_kills.json"))
    args = parser.parse_args()
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or args.kills < 1 or args.iters < 2 or args.save_interval < 1:
        print(f"bench_kills.py: error: --modes {bad or ''} --kills >= 1, --iters >= 2, "
              f"--save-interval >= 1 (modes of {', '.join(MODES)})", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="autohet-bench-kills-"))
    rows: list[dict] = []
    try:
        with moto_s3_server() as s3:
            args.s3 = s3
            ref = root / "reference"
            ref.mkdir()
            done = subprocess.run(command("sync", ref, args.iters, args.iters, None, "ref"),
                                  cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            reference = losses(ref / "m.jsonl")
            print(f"{'kill':>4} {'mode':<15} {'at it':>5} {'saved':>5} {'resumed':>7} "
                  f"{'restart s':>9}  verdict")
            for k in range(args.kills):
                row = one_kill(k, modes[k % len(modes)], root / f"kill-{k}", args, rng,
                               reference, args.timeout)
                rows.append(row)
                print(f"{k:>4} {row['mode']:<15} {row['killed_at_iteration']:>5} "
                      f"{row['last_reported_save']:>5} {row['resumed_from']:>7} "
                      f"{row['restart_s']:>9.1f}  {row['verdict']}",
                      flush=True)
                write_json(_summary(rows, args), args.json)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = _summary(rows, args)
    print(f"{summary['kills']} kills: {summary['exact']} exact, {summary['wrong']} wrong, "
          f"{summary['refused']} refused, {summary['failed']} failed "
          f"(load average {os.getloadavg()[0]:.1f})")
    return 0 if summary["exact"] == summary["kills"] else 1


def _summary(rows: list[dict], args) -> dict:
    verdicts = [r["verdict"] for r in rows]
    return {"kills": len(rows), "exact": verdicts.count("exact"),
            "wrong": verdicts.count("wrong"), "refused": verdicts.count("refused"),
            "failed": sum(v.startswith("failed") for v in verdicts),
            "iters": args.iters, "save_interval": args.save_interval, "seed": args.seed,
            "load_average": os.getloadavg(), "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
