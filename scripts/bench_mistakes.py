#!/usr/bin/env python
"""How long each mistaken command line takes to be refused: the cases of the bar in
tests/cli/test_mistakes.py (`autohet train`), each run as a user types it, one at a time, with
the load average at its start; the target is every one within 15 s.

    python scripts/bench_mistakes.py [--json bench_mistakes.json] [--repeat N]

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

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests/cli/test_mistakes.py"


def _cases_module():
    spec = importlib.util.spec_from_file_location("mistakes_cases", CASES)
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
    args = parser.parse_args()
    cases = _cases_module()
    root = Path(tempfile.mkdtemp(prefix="bench-mistakes-"))
    names = _data(cases, root)
    rows = []
    print(f"{'case':<64} {'s':>6} {'exit':>4} {'load':>6}")
    for case, case_args, _line in cases.MISTAKES:
        argv = [a.format(**names) for a in case_args]
        plan = argv[argv.index("--plan") + 1] if "--plan" in argv else names["plan"]
        argv = [a for i, a in enumerate(argv) if "--plan" not in (a, argv[i - 1] if i else None)]
        command = [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan", plan,
                   "--model", names["model"], "--data-dir", str(root), *argv]
        seconds, load = [], open("/proc/loadavg").read().split()[0]
        for _ in range(args.repeat):
            start = time.perf_counter()
            status = subprocess.run(command, capture_output=True, cwd=root).returncode
            seconds.append(time.perf_counter() - start)
        rows.append({"case": case, "seconds": round(statistics.median(seconds), 2),
                     "exit": status, "load": float(load)})
        print(f"{case:<64} {rows[-1]['seconds']:>6.1f} {status:>4} {load:>6}", flush=True)
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    within = sum(r["seconds"] <= 15 for r in rows)
    print(f"{within} of {len(rows)} within 15 s; rows in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
