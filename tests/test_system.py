"""system/parent_death.py in the launcher's own process: a launcher run in-process (as tests
and library callers do) leaves its environment as it was, and a process never takes its own pid
for its launcher's (it exited at once, silently, status 1: the test session itself, once an
in-process `autohet node` had exported its pid and a later test ran a rank's code)."""

import os

import pytest

from megatron_autohet.system.parent_death import (PARENT_PID_ENV, die_with_launcher,
                                                  exported_parent_pid)

pytestmark = pytest.mark.unit


def test_the_exported_pid_lasts_as_long_as_the_launch(monkeypatch):
    monkeypatch.delenv(PARENT_PID_ENV, raising=False)
    with exported_parent_pid():
        assert os.environ[PARENT_PID_ENV] == str(os.getpid())
    assert PARENT_PID_ENV not in os.environ


def test_a_process_is_not_its_own_launcher(monkeypatch):
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getpid()))
    die_with_launcher()                 # returns: this test session goes on
    assert PARENT_PID_ENV not in os.environ
