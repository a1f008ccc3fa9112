"""The re-plan search's child process (planner/adapt_process.py): it answers what the search
answers in-process, dies with the rank that started it even in the middle of a window, and
close() ends it whatever it is doing. The slow window is a request whose unpickling sleeps (the
child is busy receiving it): no clock is asserted, only that the process is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from helpers.windows import synthetic_window
from megatron_autohet.plan import load_plan
from megatron_autohet.planner.adapt import confirm_window, plan_fleet, replan_window
from megatron_autohet.planner.adapt_process import ReplanProcess
from megatron_autohet.profiling.from_run import priced_entries
from megatron_autohet.spec.gpus import load_gpu_catalog
from megatron_autohet.spec.precision import PRECISIONS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PLAN = load_plan(ROOT / "configs/plans/tiny-two-pipelines.yaml")
CATALOG = load_gpu_catalog()
FIXED = dict(catalog=CATALOG, precision=PRECISIONS["fp32"], attention="flash", fusions=None)


class _Sleeps:
    """Unpickled as a long sleep: a child receiving it is busy until killed."""

    def __reduce__(self):
        return time.sleep, (3600,)


def _gone(pid: int, within_s: float = 120.0) -> bool:
    """Whether ``pid`` has exited (or is a zombie nobody reaped) within ``within_s``: a bound
    for a loaded machine, not a measurement."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def test_the_process_answers_what_the_search_answers_in_process():
    fleet = plan_fleet(PLAN, CATALOG).with_speeds({("a100", 1): 0.5})
    priors = priced_entries(PLAN, CATALOG)
    search = ReplanProcess(PLAN, priors, **FIXED)
    try:
        for first in (1, 3):
            window = synthetic_window(PLAN, fleet, first, first + 1, scale=1e8)
            search.submit(window.stages, (first, first + 1))
            assert search.pending == (first, first + 1)
            there = search.result()
            assert search.pending is None
            here = replan_window(PLAN, window.stages, (first, first + 1), priors, **FIXED)
            # the same re-plan, figures and stragglers; the search's seconds are its own
            assert replace(there, search_s=0.0) == replace(here, search_s=0.0)
            assert there.plan.to_dict() == here.plan.to_dict()
            assert not there.same_layout
            # the re-plan found priced on the next window, no search: what confirm_window
            # answers in-process, and what the search priced it at on the same figures
            later = synthetic_window(PLAN, fleet, first + 2, first + 3, scale=1e8)
            again = search.confirm(later.stages, (first + 2, first + 3), there.plan)
            assert search.pending is None
            same = confirm_window(PLAN, there.plan, later.stages, (first + 2, first + 3), priors,
                                  **FIXED)
            assert replace(again, search_s=0.0) == replace(same, search_s=0.0)
            assert again.plan.to_dict() == there.plan.to_dict()
            assert (again.current, again.new) == pytest.approx((there.current, there.new))
    finally:
        search.close()


def test_close_ends_the_process_in_the_middle_of_a_window():
    search = ReplanProcess(PLAN, None, **FIXED)
    search.submit([_Sleeps()], (1, 2))
    pid = search._child.pid
    search.close()
    assert _gone(pid) and search.pending is None


PARENT = """
import sys, time
sys.path[:0] = {path!r}
from megatron_autohet.planner.adapt_process import ReplanProcess
from test_adapt_process import PLAN, FIXED, _Sleeps
search = ReplanProcess(PLAN, None, **FIXED)
search.submit([_Sleeps()], (1, 2))
print(search._child.pid, flush=True)
time.sleep(3600)
"""


def test_the_process_dies_with_its_rank_in_the_middle_of_a_window(tmp_path):
    """A rank killed outright (SIGKILL: no finally, no close) while its search process is
    busy: the kernel's parent-death signal ends the child (system/parent_death.py), which
    would otherwise sleep on, orphaned."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(path=[str(Path(__file__).parent),
                                                   str(ROOT / "tests"), str(ROOT)])],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    child = None
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _gone(child)
    finally:
        if parent.poll() is None:
            parent.kill()
        if child is not None and not _gone(child, within_s=0):
            os.kill(child, signal.SIGKILL)      # the orphan of a failed run, by its pid
