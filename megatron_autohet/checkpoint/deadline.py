"""A notice's deadline, and what may still start before it.

After a preemption notice the node's state leaves it in order of speed - to the peers that stay
(elastic/handover.py), then to S3 what exists nowhere else (checkpoint/upload.py) - and a copy
that cannot finish before the node goes is not started: half a file is worth nothing, and the
time is better left to what follows (the re-plan, whose broadcast the leaving ranks take part
in). Whether a copy fits is estimated from the bandwidth measured on what this copy's link
already carried (:class:`Throughput`); before anything was measured, a copy starts. An upload
still running when the time is up is no longer waited for (checkpoint/upload.py); a file on its
way to a peer (gloo send/recv) cannot be left like that, so the first one is sent whole.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    """``unix``: when the node goes (a notice's ``deadline_unix``); ``reserve_s``: the seconds
    before it kept for what follows the copies."""
    unix: float
    reserve_s: float

    def left(self) -> float:
        """Seconds left for copies (negative once past)."""
        return self.unix - self.reserve_s - time.time()

    def to_deadline(self) -> float:
        """Seconds to the deadline itself, for the logs (``T-12.3 s``)."""
        return self.unix - time.time()

    def fits(self, nbytes: int, rate: float | None) -> bool:
        """Whether ``nbytes`` at ``rate`` bytes/s end before :meth:`left` runs out; with no rate
        measured yet, whether any time is left."""
        left = self.left()
        return left > 0 and (rate is None or nbytes / rate <= left)


class Throughput:
    """Bytes per second over the copies done so far on one link."""

    def __init__(self):
        self.bytes = 0
        self.seconds = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.seconds += seconds

    @property
    def rate(self) -> float | None:
        return self.bytes / self.seconds if self.bytes and self.seconds > 0 else None


def against(deadline: Deadline | None) -> str:
    """`` (T-12.3 s)``: the time to the deadline, appended to a log line; empty without one."""
    return "" if deadline is None else f" (T{-deadline.to_deadline():+.1f} s)"
