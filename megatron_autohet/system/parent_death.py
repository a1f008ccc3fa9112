"""A process that dies with its parent: Linux's parent-death signal, armed without a race.

A training job's processes run in sessions of their own (torchrun starts each worker with
``start_new_session``, the warm fork server's children call ``setsid``), so nothing takes them
down when the process that started them dies without a word: kill -9 of `autohet train`, the
OOM killer, a supervisor that kills one pid, a lost ssh session. They would train on, saving into
the job's checkpoint directory beside the job the user starts next. Each of them therefore asks
the kernel for SIGKILL when its parent exits (``prctl(PR_SET_PDEATHSIG)``), which no signal
handler, hang or session can escape.

The signal comes when the *thread* that forked the process exits; every launcher here forks its
workers from its main thread (torchrun's agent, the fork server's loop), whose end is the
process's. A parent that died before the child armed the signal is caught by comparing the
parent's pid afterwards with the one the parent gave (``PARENT_PID_ENV`` or an argument).

``die_with_parent(parent_pid)``: arm the signal; exit at once (status 1, one line) when
``parent_pid`` is no longer the parent.
``die_with_launcher()``: the same for the pid a launcher exported in ``PARENT_PID_ENV`` (and
removes it, so the worker's own children do not read their grandparent's pid); nothing
without it, or where that pid is this process's own (a launcher run in-process, as tests do,
that later runs a rank's code itself).
``exported_parent_pid()``: the launcher's side, a context manager: its pid in
``PARENT_PID_ENV`` for the workers it starts meanwhile, the environment as it was afterwards.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
import os
import signal
import sys

PARENT_PID_ENV = "AUTOHET_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def _arm() -> bool:
    """Ask for SIGKILL at the parent's exit; False where the system has no such call."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def die_with_parent(parent_pid: int) -> None:
    _arm()
    if os.getppid() != parent_pid:
        print(f"autohet: the process that started this one (pid {parent_pid}) is gone: "
              "exiting", file=sys.stderr, flush=True)
        os._exit(1)


def die_with_launcher() -> None:
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is not None and parent.isdigit() and int(parent) != os.getpid():
        die_with_parent(int(parent))


@contextmanager
def exported_parent_pid():
    before = os.environ.get(PARENT_PID_ENV)
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PARENT_PID_ENV, None)
        else:
            os.environ[PARENT_PID_ENV] = before
