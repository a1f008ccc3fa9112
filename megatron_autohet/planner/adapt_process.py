"""The re-plan search of each measurement window in a process of its own, off the training's
critical path (planner/adapt.py ``replan_window``; job.py ``adapt_sink`` drives it).

Between two iterations the search would stall the rank that decides, and every other rank with
it at the next collective: 0.06-0.10 s on a tiny plan, seconds on a large fleet, every window.
So the deciding rank hands a window's measurements to a child process and trains on; the job
takes the answer at a fixed iteration (the next window's end, waiting there if the search is
not done), so where a run switches depends on its inputs alone, never on the machine's load.

Why a process, not a thread: SCIP (pyscipopt) does not reliably release the GIL while it
solves, so a thread would still stall the iterations. Why a fresh interpreter
(``python -m megatron_autohet.planner.adapt_process``, what multiprocessing's spawn starts, but
without spawn running the rank's main module again: pretrain_gpt.py's would import torch and
Megatron-LM a second time): a fork of a rank would copy a process holding torch's threads and
gloo's sockets. The process is started once per generation (its imports overlap the first
window) and serves every window of it; it is the rank's child and dies with it
(system/parent_death.py: a rank killed outright leaves no search behind), ignores Ctrl-C (the
rank decides when it ends) and is killed at :meth:`ReplanProcess.close` (a search has nothing
to flush): at the job's end and at a plan switch.

:class:`ReplanProcess`: ``submit(stages, window)``, ``pending`` (the window submitted, None
when none), ``result()`` (the :class:`~megatron_autohet.planner.adapt.Replan`, waiting for it;
ConfigError where no plan fits), ``confirm(stages, window, candidate)`` (a re-plan found before,
priced on this window without a search: planner/adapt.py ``confirm_window``; the rank waits for
it, which it asks only where a switch is in view: the cost model on two plans, not a search),
``close()``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection

from megatron_autohet.errors import ConfigError
from megatron_autohet.known_warnings import ignore_known_warnings
from megatron_autohet.planner.adapt import confirm_window, replan_window
from megatron_autohet.system.parent_death import die_with_parent

_MODULE = "megatron_autohet.planner.adapt_process"


class ReplanProcess:
    """The child process of one generation's searches (module doc). ``plan``, ``priors`` and
    the keywords of ``replan_window`` (catalog, precision, attention, fusions, template) are the
    same for every window: sent once."""

    def __init__(self, plan, priors, **fixed):
        ours, theirs = socket.socketpair()
        # the child imports what this process imports from (a test's or a checkout's path)
        path = os.pathsep.join([p for p in sys.path if p]
                               + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self._child = subprocess.Popen(
            [sys.executable, "-m", _MODULE, str(os.getpid()), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path})
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((plan, priors, fixed))
        self.pending: tuple[int, int] | None = None

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._child.pid

    def submit(self, stages, window: tuple[int, int], idle_measured=None) -> None:
        """Search ``window`` (its StageMeasures ``stages``; ``idle_measured``: replan_window's,
        what the idle GPUs have measured so far); the answer waits for :meth:`result`."""
        assert self.pending is None, "one search at a time: result() first"
        self._conn.send((stages, window, None, idle_measured))
        self.pending = window

    def result(self):
        """The pending window's Replan, waiting for the search to end."""
        try:
            return self._answer()
        finally:
            self.pending = None

    def confirm(self, stages, window: tuple[int, int], candidate, idle_measured=None):
        """The Replan of ``candidate`` on ``window`` (its StageMeasures ``stages``), priced
        without a search, waited for (module doc)."""
        assert self.pending is None, "one request at a time: result() first"
        self._conn.send((stages, window, candidate, idle_measured))
        return self._answer()

    def _answer(self):
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the re-plan search process (pid {self._child.pid}) ended "
                               f"without an answer (exit status {self._child.poll()})") from None
        if kind == "config":
            raise ConfigError(*value)
        if kind == "error":
            raise RuntimeError(f"the re-plan search failed:\n{value}")
        return value

    def close(self) -> None:
        """End the process, whatever it is doing (module doc)."""
        self._child.kill()
        self._child.wait()
        self._conn.close()
        self.pending = None


def _serve(parent_pid: int, fd: int) -> None:
    """The child: the fixed inputs, then one window after another until the rank closes it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)     # a rank gone before this line is caught by the pid check
    ignore_known_warnings()
    conn = Connection(fd)
    try:
        plan, priors, fixed = conn.recv()
        while True:
            stages, window, candidate, idle_measured = conn.recv()
            inputs = dict(fixed, idle_measured=idle_measured)
            try:
                reply = ("ok", replan_window(plan, stages, window, priors, **inputs)
                         if candidate is None else
                         confirm_window(plan, candidate, stages, window, priors, **inputs))
            except ConfigError as err:
                reply = ("config", (err.file, err.field, err.problem, err.allowed))
            except Exception:  # noqa: BLE001 - the rank raises it, with this traceback
                reply = ("error", traceback.format_exc())
            conn.send(reply)
    except EOFError:            # the rank closed its end
        return


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
