"""The events of an elastic job, each one Megatron-style console line and one JSON line.

Events: ``fleet`` (who is present after a (re)start), ``plan`` (kept or re-planned, and how long
that took), ``recovery`` (bytes per tier, seconds), ``first_iteration`` (seconds from the worker's
start to the end of its first iteration), ``stop`` (why, which nodes leave, the save's seconds),
``finished``. One rank writes (rank 0 of the job); the JSONL file is appended to, so the events
of every restart of a job end up in one file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class EventLog:
    def __init__(self, jsonl: str | Path | None, *, enabled: bool):
        self.enabled = enabled
        self.path = Path(jsonl) if jsonl and enabled else None

    def emit(self, event: str, message: str, **fields) -> None:
        if not self.enabled:
            return
        print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] autohet {event}: {message}", flush=True)
        if self.path is not None:
            record = {"event": event, "time_unix": round(time.time(), 3), **fields}
            with self.path.open("a") as out:
                out.write(json.dumps(record, sort_keys=False) + "\n")
