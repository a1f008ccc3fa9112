"""The multi-process harness's hang guard (tests/helpers/dist_utils.py): it counts seconds of an
unloaded machine, so a busy machine does not fail a healthy run, and a hang still ends."""

import os
import subprocess
import sys
import time

import pytest

from helpers.dist_utils import LoadClock, RankFailed, run_on_ranks

pytestmark = pytest.mark.integration


def _hang(rank, world_size):
    time.sleep(3600)


def test_a_hung_rank_still_fails_the_run():
    with pytest.raises(RankFailed, match=r"ranks \[0, 1\] did not finish within 3 s"):
        run_on_ranks(2, _hang, timeout=3)


def test_the_clock_runs_slower_while_every_core_is_busy():
    """Two busy processes per core: the clock advances by less than half the wall time (each
    runnable thread gets at most a third of a core)."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(1.0)                             # the busy loops are running
        clock, wall = LoadClock(), time.monotonic()
        for _ in range(20):
            time.sleep(0.1)
            loaded = clock.seconds()
        assert loaded < 0.5 * (time.monotonic() - wall)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
