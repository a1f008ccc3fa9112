"""The events of an elastic job, each one Megatron-style console line and one JSON line.

Events: ``fleet`` (who is present after a (re)start, which nodes are gone or new since the saved
plan), ``plan`` (kept or re-planned, how long that took, idle GPUs), ``handover`` (idle nodes'
files sent to training nodes), ``recovery`` (bytes per tier, seconds per phase),
``first_iteration`` (seconds from the (re)start to the end of its first iteration), ``stop``
(why, which nodes leave), ``saved`` (seconds from the stop until its checkpoint was written, and
uploaded with an S3 tier), ``evacuate`` (a leaving node's files copied to the nodes that stay),
``finished``. One rank writes (the plan's rank 0); the JSONL file is appended to, so the events of
every restart of a job end up in one file.
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
