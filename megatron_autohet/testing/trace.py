"""Preemption traces in the format of the public Bamboo/Oobleck spot traces.

One event per line, ``ms,add|remove,node[,notice|no-notice]``: milliseconds since the start of
the trace, whether the node joins or leaves the fleet, its name (``0,add,node0``), and for a
removal optionally whether the node got a preemption notice first (``notice``) or was lost
without one (``no-notice``; the public traces do not say: a replay decides). An optional first
line of column names (``ms,action,node[,notice]``), blank lines and ``#`` comments are allowed.
Real traces list several nodes at the same millisecond (one reclaim takes several VMs):
:func:`steps` groups them, so a replay delivers them together. Traces replay a real fleet's
preemptions against an emulated one: :func:`fleet_over_time` says which nodes are up when.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_autohet.errors import ConfigError

ACTIONS = ("add", "remove")
NOTICES = {"notice": True, "no-notice": False}
LINE_ALLOWED = ("'ms,add|remove,node[,notice|no-notice]': ms an integer >= 0, node a name "
                "without spaces, the fourth column on removals only")


@dataclass(frozen=True)
class TraceEvent:
    ms: int                 # milliseconds since the start of the trace
    action: str             # "add" or "remove"
    node: str
    notice: bool | None = None   # a removal with a preemption notice (True), without (False);
                                 # None: the trace does not say (always None for an add)


@dataclass(frozen=True)
class TraceStep:
    """The events of one millisecond of a trace: one change of the fleet, delivered at once."""
    ms: int
    events: tuple[TraceEvent, ...]


def load_trace(path: str | Path, initial: tuple[str, ...] | list[str] = ()) -> list[TraceEvent]:
    """The events of the trace file ``path``, sorted by time (events at the same time keep their
    order in the file). Every line is checked, and so is the fleet they describe, starting from
    the nodes ``initial``: adding a node that is up or removing one that is not is an error
    naming the line."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(path, "<file>", "file not found", "a path to an existing trace file")
    lines = [(number, raw.split("#", 1)[0].strip())
             for number, raw in enumerate(text.splitlines(), start=1)]
    lines = [(number, line) for number, line in lines if line]
    if lines and _is_header(lines[0][1]):
        lines = lines[1:]
    numbered = [(number, _parse_line(line, path, number)) for number, line in lines]
    numbered.sort(key=lambda item: item[1].ms)
    fleet = list(initial)
    for number, event in numbered:
        problem = _apply(fleet, event)
        if problem:
            raise ConfigError(path, f"line {number}", problem,
                              "add a node that is not up, remove one that is")
    return [event for _, event in numbered]


def _is_header(line: str) -> bool:
    """A column-name line such as ``ms,action,node``: three or four fields, no time, no action
    (so a mistyped first event is still reported)."""
    parts = [part.strip() for part in line.split(",")]
    return len(parts) in (3, 4) and not _is_ms(parts[0]) and parts[1] not in ACTIONS


def _is_ms(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _parse_line(line: str, path, number: int) -> TraceEvent:
    parts = [part.strip() for part in line.split(",")]
    if len(parts) not in (3, 4):
        raise ConfigError(path, f"line {number}", f"{line!r} has {len(parts)} field(s)",
                          LINE_ALLOWED)
    ms, action, node, notice = parts + [""] * (4 - len(parts))
    if not _is_ms(ms):
        raise ConfigError(path, f"line {number}", f"time {ms!r}", LINE_ALLOWED)
    if action not in ACTIONS:
        raise ConfigError(path, f"line {number}", f"action {action!r}", "add, remove")
    if not node or any(c.isspace() for c in node):
        raise ConfigError(path, f"line {number}", f"node {node!r}", LINE_ALLOWED)
    if notice and notice not in NOTICES:
        raise ConfigError(path, f"line {number}", f"notice column {notice!r}",
                          "notice, no-notice, or nothing")
    if notice and action != "remove":
        raise ConfigError(path, f"line {number}", f"{notice!r} on an add",
                          "the notice column on removals only")
    return TraceEvent(int(ms), action, node, NOTICES[notice] if notice else None)


def _apply(fleet: list[str], event: TraceEvent) -> str | None:
    """Apply ``event`` to ``fleet`` in place; what is wrong with it, or None."""
    if event.action == "add":
        if event.node in fleet:
            return f"{event.ms} ms: add {event.node}, which is already up"
        fleet.append(event.node)
    else:
        if event.node not in fleet:
            return f"{event.ms} ms: remove {event.node}, which is not up"
        fleet.remove(event.node)
    return None


def steps(events: list[TraceEvent]) -> list[TraceStep]:
    """The events grouped by millisecond, in time order (each group in the trace's order)."""
    out: list[TraceStep] = []
    for event in sorted(events, key=lambda e: e.ms):
        if out and out[-1].ms == event.ms:
            out[-1] = TraceStep(event.ms, out[-1].events + (event,))
        else:
            out.append(TraceStep(event.ms, (event,)))
    return out


def fleet_over_time(events: list[TraceEvent],
                    initial: tuple[str, ...] | list[str] = ()) -> list[tuple[int, tuple[str, ...]]]:
    """``(ms, nodes up)`` after each point in time with events, starting from ``initial``:
    events at the same millisecond count as one change (a fleet that never existed, between two
    simultaneous events, is not listed). Nodes are in the order they joined. A ValueError when an
    event does not fit the fleet (a trace from :func:`load_trace` with the same ``initial``
    always fits)."""
    fleet = list(initial)
    timeline: list[tuple[int, tuple[str, ...]]] = []
    for step in steps(events):
        for event in step.events:
            problem = _apply(fleet, event)
            if problem:
                raise ValueError(problem)
        timeline.append((step.ms, tuple(fleet)))
    return timeline
