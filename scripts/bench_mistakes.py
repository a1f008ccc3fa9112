#!/usr/bin/env python
"""How long each mistaken command line takes to be refused: the cases of the bar in
tests/cli/test_mistakes.py (`autohet train`) and, with ``--megatron-lm``, those of
tests/megatron/test_megatron_lm.py (`autohet torchrun ... pretrain_gpt.py --autohet-plan`), each
run as a user types it, one at a time, with the load average at its start; the target is every
one within 15 s.

    python scripts/bench_mistakes.py [--megatron-lm DIR] [--json bench_mistakes.json] [--repeat N]

DIR: a Megatron-LM checkout at core_v0.16.1 set up by scripts/setup_megatron_lm.sh (its
pretrain_gpt.py is the script the cases name).

Prints a table (case, seconds, exit status, load average) and writes the rows as JSON. The
seconds are wall time of the whole command, start-up included; on a loaded machine they grow
with the load (a case that imports megatron-core pays most).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_autohet.known_warnings import ignore_known_warnings

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests/cli/test_mistakes.py"
MEGATRON_CASES = ROOT / "tests/megatron/test_megatron_lm.py"


def _cases_module(path: Path = CASES):
    sys.path.append(str(ROOT / "tests"))     # the test modules' helpers (last: tests/megatron)
    spec = importlib.util.spec_from_file_location(path.stem + "_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data(cases, root: Path) -> dict[str, str]:
    """The files the cases name, as the test's fixture makes them."""
    import numpy as np

    good = cases._dataset(root / "good" / "text")
    other = cases._dataset(root / "other" / "text", docs=5)
    (root / "torn").mkdir()
    (root / "torn" / "text.bin").write_bytes(other.with_suffix(".bin").read_bytes())
    (root / "torn" / "text.idx").write_bytes(good.with_suffix(".idx").read_bytes())
    data = {"root": root, "good": good, "small": cases._dataset(root / "small" / "text",
                                                                  dtype=np.uint8),
            "torn": root / "torn" / "text", "fleet": cases._fleet_plan(root / "fleet.yaml")}
    return {**{k: str(v) for k, v in data.items()}, "plan": str(cases.PLAN),
            "model": str(cases.MODEL)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_mistakes.json", help="rows written here")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case (median kept)")
    parser.add_argument("--megatron-lm", type=Path, default=None, metavar="DIR",
                        help="also time the Megatron-LM path's cases, with DIR's pretrain_gpt.py")
    args = parser.parse_args()
    ignore_known_warnings()             # the cases' data are written with megatron-core
    if args.megatron_lm and not (args.megatron_lm / "pretrain_gpt.py").is_file():
        parser.error(f"--megatron-lm: {args.megatron_lm}/pretrain_gpt.py not found (allowed: a "
                     "Megatron-LM checkout set up by scripts/setup_megatron_lm.sh)")
    root = Path(tempfile.mkdtemp(prefix="bench-mistakes-"))
    commands = _train_commands(_cases_module(), root)
    if args.megatron_lm:
        commands += _torchrun_commands(_cases_module(MEGATRON_CASES), root, args.megatron_lm)
    rows = []
    print(f"{'case':<64} {'s':>6} {'exit':>4} {'load':>6}")
    for case, command, cwd in commands:
        seconds, load = [], open("/proc/loadavg").read().split()[0]
        for _ in range(args.repeat):
            start = time.perf_counter()
            status = subprocess.run(command, capture_output=True, cwd=cwd).returncode
            seconds.append(time.perf_counter() - start)
        rows.append({"case": case, "seconds": round(statistics.median(seconds), 2),
                     "exit": status, "load": float(load)})
        print(f"{case:<64} {rows[-1]['seconds']:>6.1f} {status:>4} {load:>6}", flush=True)
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    within = sum(r["seconds"] <= 15 for r in rows)
    print(f"{within} of {len(rows)} within 15 s; rows in {args.json}")
    return 0


def _train_commands(cases, root: Path) -> list[tuple[str, list[str], Path]]:
    """(case, command, directory) of each `autohet train` case."""
    names = _data(cases, root)
    commands = []
    for case, case_args, _line in cases.MISTAKES:
        argv = [a.format(**names) for a in case_args]
        plan = argv[argv.index("--plan") + 1] if "--plan" in argv else names["plan"]
        argv = [a for i, a in enumerate(argv) if "--plan" not in (a, argv[i - 1] if i else None)]
        commands.append((case, [sys.executable, "-m", "megatron_autohet.cli.main", "train",
                                "--plan", plan, "--model", names["model"], "--data-dir",
                                str(root), *argv], root))
    return commands


def _torchrun_commands(cases, root: Path, tree: Path) -> list[tuple[str, list[str], Path]]:
    """(case, command, directory) of each Megatron-LM path case, as the test types it."""
    ckpt = root / "empty-checkpoint"
    ckpt.mkdir()
    names = {"ckpt": ckpt, "plan": cases.PLAN}
    commands = []
    for case, case_args, options, _line in cases.MISTAKES:
        commands.append((f"pretrain_gpt.py: {case}", [
            sys.executable, "-m", "megatron_autohet.cli.main", "torchrun", "--nproc-per-node",
            "4", *options, "pretrain_gpt.py", "--autohet-plan", str(cases.PLAN),
            *cases.TINY_ARGS, *(a.format(**names) for a in case_args), "--autohet-data-dir",
            str(root)], tree))
    return commands


if __name__ == "__main__":
    sys.exit(main())
