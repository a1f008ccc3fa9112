"""The events of an elastic job, each one Megatron-style console line and one JSON line.

Events: ``fleet`` (who is present after a (re)start or an in-process re-plan, which nodes are
gone or new since the saved plan), ``plan`` (kept or re-planned, how long that took, idle
GPUs), ``handover`` (idle nodes' files sent to training nodes), ``recovery`` (bytes per tier,
seconds per phase), ``first_iteration`` (seconds from the (re)start to the end of its first
iteration), ``stop`` (why, which nodes leave), ``saved`` (seconds from the stop until its
checkpoint was written, and uploaded with an S3 tier), ``evacuate`` (a leaving node's files
copied to the nodes that stay), ``upload`` (after a notice with a deadline: the S3 upload of
what exists only on leaving nodes, or why none), ``drift`` (every measurement window of
``--autohet-measure-window``: the stages more than 10% off their predictions, each with its
predicted and measured seconds per micro-batch and their ratio; runtime/stage_drift.py),
``adapt`` (with ``--autohet-adapt log``, every window: the re-plan considered on what it
measured, its predicted gain, switch cost, gain amortised over the iterations left, the
decision and why, the stragglers; planner/adapt.py), ``finished``. One rank writes: the plan's rank
0, except for the in-process re-plan after a preemption notice (its ``fleet`` and ``plan``),
which the first rank that stays writes - the plan's rank 0 may be on a leaving node. Each JSON
line names the node that wrote it (``reported_by``). The JSONL file is appended to, so the
events of every restart of a job end up in one file. ``sink(event, message)``: each event also
goes there (the job's TensorBoard / W&B text entries, runtime/dashboard.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class EventLog:
    def __init__(self, jsonl: str | Path | None, *, enabled: bool, node: str | None = None,
                 sink=None):
        self.enabled = enabled
        self.sink = sink
        self.node = node
        self.path = Path(jsonl) if jsonl and enabled else None

    def emit(self, event: str, message: str, **fields) -> None:
        if not self.enabled:
            return
        print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] autohet {event}: {message}", flush=True)
        if self.sink is not None:
            self.sink(event, message)
        if self.path is not None:
            record = {"event": event, "time_unix": round(time.time(), 3), **fields,
                      **({"reported_by": self.node} if self.node else {})}
            with self.path.open("a") as out:
                out.write(json.dumps(record, sort_keys=False) + "\n")
