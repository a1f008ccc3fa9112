"""Holding an elastic job at an iteration boundary, so a fleet event lands after a known iteration.

When a preemption, a loss or a join reaches the job depends on wall-clock time, and so do the
layouts each iteration is trained on. A test that compares the job's losses with an
uninterrupted run needs the same iterations on the same layouts every time, so it holds the job:
with ``AUTOHET_HOLD_FILE=PATH`` in the nodes' environment (torchrun passes it on to the
workers), every worker reads PATH after each iteration and, while the file holds the number of
the iteration just finished, waits there - before the stop check's all-reduce, so every rank
waits at the same boundary - until the file says something else or is removed. Meanwhile the
test triggers the event (writes a notice, kills a node, starts one), then moves the hold on.

A signal also releases the hold (torchrun stopping the workers because a node joins): the stop
it asks for lands after the held iteration.

``0`` holds every (re)started worker before it trains, where SIGTERM still ends the process: a
test waits there for the round it wants (the nodes of a fleet start at different times, and the
rendezvous starts a round with the first two) before the job's first iteration.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from megatron_autohet.checkpoint.manifest import write_atomic

HOLD_FILE_ENV = "AUTOHET_HOLD_FILE"
_POLL_S = 0.05


def hold_file_from_env() -> Path | None:
    path = os.environ.get(HOLD_FILE_ENV)
    return Path(path) if path else None


def held_at(path: Path) -> int | None:
    """The iteration ``path`` holds the job after; None when there is no file or no number."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def wait_while_held(path: Path, iteration: int, released: Callable[[], bool]) -> None:
    """After ``iteration``: wait while ``path`` holds it and ``released()`` is false."""
    while held_at(path) == iteration and not released():
        time.sleep(_POLL_S)


def hold_after(path: Path, iteration: int | None) -> None:
    """Hold the job after ``iteration`` (None: hold nowhere). Atomic, so a worker reads the old
    number or the new one."""
    write_atomic(path, b"" if iteration is None else f"{iteration}\n".encode())
