"""Telling a lost node from a busy one: when `autohet node`'s agents declare a member of their
rendezvous round lost without notice (pure: no torch, no clock of its own).

Every agent writes a keep-alive into the rendezvous state every second (torch's c10d rendezvous:
``_RendezvousState.last_heartbeats``, the writer's wall-clock time), and every agent reads that
state every 0.1 s (its monitor loop). A member lost without notice is one whose keep-alive stops.
But a keep-alive also stops for seconds on a live node that does not get the CPU: a loaded host
(data loaders, a checkpoint being compressed, swapping), a long pause of the process, a slow
network to the store. Each false loss costs a new rendezvous round and up to a save interval of
training (every agent SIGKILLs its workers), so a loss is confirmed first:

* A member is lost once its keep-alive, as this agent read it from the store poll after poll,
  has not changed for ``--loss-timeout`` seconds (:data:`DEFAULT_LOSS_TIMEOUT_S` by default) by
  this agent's own monotonic clock, and it was already overdue (unchanged for the timeout less
  :data:`CONFIRM_S`) at :data:`CONFIRM_POLLS` polls or more over the last :data:`CONFIRM_S`
  seconds of them. The second condition is for an agent that got no CPU itself: it read nothing
  meanwhile, so at its first poll after the gap every keep-alive looks old; it then gives the
  members :data:`CONFIRM_S` seconds (two keep-alives) to show they are alive. A member whose
  keep-alive changes at any poll before that starts again from zero: it is not lost.
* An agent never judges its own keep-alive: its own lapse (it was the one without CPU) is no
  loss. It leaves its round only when the others do (they confirmed it lost, or another member)
  or when another member lapses as above.
* torch applies its own expiry to the same keep-alives, on one reading, in every agent's sync
  (``_BackendRendezvousStateHolder._sanitize``: a node whose keep-alive is older than
  ``keep_alive_interval * keep_alive_max_attempt`` is dropped from the state, an agent's own
  included, for good: it stops sending keep-alives then). That expiry is set from the same
  ``--loss-timeout``, one keep-alive interval after it (:func:`expiry_attempts`): torch removes a
  lost member from the state - which the next round needs, since the round's participants must
  be gone for it to start - just after the agents confirmed the loss, never long before.
  Both live in the rendezvous settings (:func:`rdzv_conf`: ``loss_timeout`` is read by the
  autohet-c10d backend, which derives torch's ``keep_alive_max_attempt`` from it), so one number
  sets both. Give every node of a job the same ``--loss-timeout``: torch's expiry of the node
  with the shortest one applies to all.
* A node waiting to join (torch's wait list) makes the agents restart their workers to admit it;
  it counts while its keep-alive was seen changing within the loss timeout, the same standard as
  a member's: a waiting agent gets the CPU no more often than a member's (on a loaded host its
  keep-alive lands every 5-15 s: torch's join loop writes it between one-second sleeps and
  compare-and-set retries; with a 5 s window, three nodes of a 4-node job at load 24 on 2 cores
  waited 18 minutes while the first trained alone). The next round's last call then waits for
  the waiting nodes that are fresh by the same rule (elastic/rendezvous.py), so a joiner seen
  alive is in the round that admits it; a standby that died while it waits holds one round's
  last call until it is no longer fresh, at most the loss timeout.

The cost, both ways (docs/spot.md has the measurements): a node really lost is confirmed about
``--loss-timeout`` seconds after its last keep-alive (then its peers' workers are killed; the
next round forms a second later); a live node whose agent gets no CPU for less than that is
never declared lost. 20 s by default: on a real fleet a loss without notice is rare and already
costs the iterations since the last save (minutes), so 20 s more is small, while a false loss
costs as much as a real one and is common on loaded hosts at torch's 3 s. Shorter (at least
:data:`MIN_LOSS_TIMEOUT_S`) for tests and emulated fleets, longer for hosts with long stalls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

from megatron_autohet.errors import ConfigError, positive

# torch's keep-alive period (its c10d ``keep_alive_interval``, whole seconds).
KEEP_ALIVE_INTERVAL_S = 1
DEFAULT_LOSS_TIMEOUT_S = 20.0
# The last part of the timeout during which an overdue member is watched at several polls.
CONFIRM_S = 2.0
CONFIRM_POLLS = 3
# Below this, overdue would begin after less than two keep-alive intervals of silence.
MIN_LOSS_TIMEOUT_S = CONFIRM_S + 2 * KEEP_ALIVE_INTERVAL_S
FLAG = "--loss-timeout"


def check_loss_timeout(value: float, flag: str = FLAG, source: str = "<command line>") -> float:
    """``value`` as a loss timeout, or a ConfigError naming ``flag`` and what is allowed."""
    positive(value, flag, source)
    if value < MIN_LOSS_TIMEOUT_S:
        raise ConfigError(source, flag, f"got {value:g}",
                          f"seconds >= {MIN_LOSS_TIMEOUT_S:g} (keep-alives come every "
                          f"{KEEP_ALIVE_INTERVAL_S} s; {DEFAULT_LOSS_TIMEOUT_S:g} by default)")
    return value


def expiry_attempts(loss_timeout_s: float) -> int:
    """torch's ``keep_alive_max_attempt`` for ``loss_timeout_s``: its expiry (interval x
    attempts) one keep-alive interval after the loss timeout (module doc)."""
    return math.ceil(loss_timeout_s / KEEP_ALIVE_INTERVAL_S) + 1


def rdzv_conf(loss_timeout_s: float) -> str:
    """`autohet node`'s ``--rdzv-conf`` for torchrun (cli/node.py says why each setting)."""
    return (f"is_host=false,last_call_timeout=1,keep_alive_interval={KEEP_ALIVE_INTERVAL_S},"
            f"loss_timeout={loss_timeout_s:g}")


@dataclass
class _Seen:
    value: object                   # the keep-alive as last read
    since: float                    # when this agent first read that value
    overdue_at: float | None = None     # the first poll at which it was overdue
    overdue_polls: int = 0


class KeepAlives:
    """What one agent saw of the rendezvous state's keep-alives, poll by poll (module doc):
    :meth:`observe` at every poll with the state's ``last_heartbeats`` and this agent's
    monotonic time; :meth:`lost` the members confirmed lost; :meth:`fresh` whether a node's
    keep-alive changed within the loss timeout."""

    def __init__(self, loss_timeout_s: float, *, confirm_s: float = CONFIRM_S,
                 confirm_polls: int = CONFIRM_POLLS):
        self.loss_timeout_s = loss_timeout_s
        self.confirm_s = min(confirm_s, loss_timeout_s)
        self.confirm_polls = confirm_polls
        self._seen: dict[Hashable, _Seen] = {}
        self._now: float | None = None

    def observe(self, heartbeats: Mapping[Hashable, object], now: float) -> None:
        overdue_after = self.loss_timeout_s - self.confirm_s
        for node, value in heartbeats.items():
            seen = self._seen.get(node)
            if seen is None or seen.value != value:
                self._seen[node] = _Seen(value, now)        # alive: from zero again
                continue
            if now - seen.since >= overdue_after:
                if seen.overdue_at is None:
                    seen.overdue_at = now
                seen.overdue_polls += 1
        for gone in set(self._seen) - set(heartbeats):      # out of the state
            del self._seen[gone]
        self._now = now

    def lost(self, members: Iterable[Hashable]) -> set:
        """The ``members`` whose keep-alive this agent saw unchanged for the loss timeout, and
        overdue at enough polls over the confirmation window."""
        if self._now is None:
            return set()
        found = set()
        for member in members:
            seen = self._seen.get(member)
            if (seen is not None and seen.overdue_at is not None
                    and self._now - seen.since >= self.loss_timeout_s
                    and self._now - seen.overdue_at >= self.confirm_s
                    and seen.overdue_polls >= self.confirm_polls):
                found.add(member)
        return found

    def fresh(self, node: Hashable) -> bool:
        """Whether ``node``'s keep-alive changed (or first appeared) within the loss timeout of
        the last poll (a node waiting to join that still lives: module doc)."""
        seen = self._seen.get(node)
        return (seen is not None and self._now is not None
                and self._now - seen.since <= self.loss_timeout_s)
