"""scripts/gpu_wheels.sh's command line: --help prints its usage, bad arguments are one line and
status 2 (nothing is downloaded in either case)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def gpu_wheels(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts/gpu_wheels.sh"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.unit
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_what_the_script_does(flag):
    done = gpu_wheels("3.12", flag)
    assert done.returncode == 0 and done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0] == "usage: scripts/gpu_wheels.sh [-h|--help] [VERSION ...]"
    assert lines[2].startswith("Fetches into .whl/ the wheels scripts/gpu_check.sh installs")
    assert "  scripts/gpu_wheels.sh 3.11 3.12   # CPython 3.11's and 3.12's" in lines
    assert not any(line.startswith(("#", "set ")) for line in lines)


@pytest.mark.unit
@pytest.mark.parametrize("args, line", [
    (["--foo"], "gpu_wheels.sh: error: unknown option '--foo' (allowed: -h, --help, or Python "
                "versions 3.11, 3.12, ...)"),
    (["3.12", "3.x"], "gpu_wheels.sh: error: '3.x' is not a Python version (allowed: 3.11, "
                      "3.12, ...)")])
def test_a_bad_argument_is_one_line_and_status_2(args, line):
    done = gpu_wheels(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [line]
