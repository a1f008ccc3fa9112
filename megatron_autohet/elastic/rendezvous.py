"""The rendezvous of `autohet node`'s torchrun agents: torchrun's own c10d rendezvous (same
state, same store, same rounds), registered as the backend ``autohet-c10d``, except that an agent
whose round fails joins the next round instead of ending.

torchrun's agent treats an error of its rendezvous as the end: the agent exits, and on its way
out closes the job's rendezvous for good (``launch_agent``: ``finally:
rdzv_handler.shutdown()``), so every other agent's next round fails with
RendezvousClosedError and the job cannot restart any more. On a spot fleet a round fails for
reasons that say nothing about the job:

* a node that arrives while too few nodes are up, or that is not admitted yet, waits in the
  rendezvous; after ``join_timeout`` (600 s by default) torchrun gives up on it
  (RendezvousTimeoutError);
* a node that is reclaimed right after its round completed, as that round's rank 0, never
  publishes the workers' store address: the round's other agents fail after the store's
  ``read_timeout`` (``DistStoreError: wait timeout after 60000ms, keys:
  /torch.rendezvous.JOB.N/MASTER_ADDR``).

* a round's agent that dies before the agents have assigned their workers' ranks: the others
  time out reading its entry (the same ``read_timeout``), after the rendezvous, in torchrun's
  agent, where no handler sees it - `autohet node` starts its agent again (cli/node.py).

Here such an agent leaves the failed round (its first step of every round) and waits in the next
one: a standby node until it is admitted, whatever the wait. And an agent that ends never closes
the rendezvous on its way out (``shutdown`` only stops its keep-alive: a node whose agent ended
drops out of the rendezvous after the loss timeout, as a lost node does); `autohet node` closes it
(:func:`close`) when its workers finished the job, so nodes still waiting learn that the job is
over. A closed rendezvous ends the agent (RendezvousClosedError, also for a node waiting beyond
``--nnodes``' maximum): `autohet node` then exits 0.

A job that stops for good (its checkpoint saves failed: the last one, or
``--autohet-max-failed-saves`` in a row; no plan for the fleet present; no checkpoint step the
fleet present can serve): torchrun's agents restart workers whatever their exit
status, so a worker that stops the job (:func:`stop_for_good`) first leaves why in the job's
rendezvous store, then exits with :data:`EXIT_STOPPED`. Every agent looks for that line before
it joins a round and when it finds the rendezvous closed; finding it, the agent closes the
rendezvous (so nodes waiting in it learn too) and raises :class:`JobStopped`: `autohet node`
prints the line and exits with EXIT_STOPPED, which scripts/launch_node.sh does not restart.

A node lost without notice (its processes killed, its network cut): torchrun's agents restart
their workers only when one of their own workers fails or a node waits to join. The survivors'
workers are blocked in a collective with the lost node's: when its processes died, gloo's
closed connections may fail them at once, but often do not (a rank that only talks to live
peers waits for them, and they for it); when its network is cut nothing fails. They then wait
for the process group's timeout (``--distributed-timeout-minutes``, 10 minutes by default), and
would then fail their checkpoint or stop check. Here every agent also watches the members of its
round in the rendezvous state it polls anyway (:meth:`PersistentRendezvous.num_nodes_waiting`,
every 0.1 s). A member that left the round (its agent started the next round: its workers
failed, or it confirmed a loss itself), or whose keep-alive this agent saw unchanged for the
loss timeout (``loss_timeout`` in the rendezvous settings, `autohet node --loss-timeout`, 20 s
by default) and still unchanged over the last 2 s of it at several polls (elastic/liveness.py:
a busy node whose agent got no CPU for a while is not a lost one, and an agent's own lapse is
never a loss), and who had not announced that it was leaving, is lost. The agent then kills its
own workers (``stop_workers``: SIGKILL - they cannot save a step the lost node's ranks hold, and
a worker blocked in a collective would not see SIGTERM, which torchrun follows with SIGKILL only
30 s later) and restarts them in the next round; the job goes on from the newest checkpoint,
losing at most the iterations since the last save. The next round forms once torch's own expiry
(``keep_alive_max_attempt``, derived from the loss timeout here: one keep-alive interval later)
has removed the lost member from the state. A node that got a preemption notice announces
in the store that it is leaving (``notice_file``) before its workers stop: the others re-plan
in-process and train on, and its agent's later end is no loss. A node waiting to join comes
first: the workers then stop at an iteration boundary and save (SIGTERM), as torchrun does; a
waiting node counts while its keep-alive is seen changing within the loss timeout (a standby
that died waiting does not restart every round until torch drops it).

The round that admits waiting nodes: torch's round completes at the end of its last call
(``last_call_timeout``, 1 s here) after its first member joined, whoever joined by then. The
agents that wait to join see the round open only at their next read of the state, which on a
loaded host comes 5-15 s apart: such a round completes without them, they still wait, the
agents restart to admit them, and the next round completes without them again - a livelock in
which no worker trains (4 emulated nodes at load 39-44 on 2 cores: 7 restarts in 7 minutes).
Here the last call holds while a node of the wait list is fresh (its keep-alive seen changing
within the loss timeout: elastic/liveness.py) - such a node adds itself at its next read, and
the round completes at once when it has ``--nnodes``' maximum - and at most the loss timeout
past torch's last call (the state's deadline, one clock for every agent), so a standby that
died waiting holds one round for at most the loss timeout (20 s by default), never longer.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Callable

from torch.distributed import DistStoreError, TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (_Action, _RendezvousContext,
                                                                      _RendezvousJoinOp,
                                                                      _should_keep_alive)
from torch.distributed.elastic.rendezvous import (RendezvousClosedError,
                                                  RendezvousGracefulExitError,
                                                  RendezvousHandler, RendezvousParameters,
                                                  RendezvousTimeoutError,
                                                  rendezvous_handler_registry)

from megatron_autohet.elastic.liveness import (DEFAULT_LOSS_TIMEOUT_S, KEEP_ALIVE_INTERVAL_S,
                                               KeepAlives, check_loss_timeout, expiry_attempts)
from megatron_autohet.elastic.notices import preempt_notice_in

BACKEND = "autohet-c10d"
# Exit status of a worker, and of `autohet node`, when the job stopped for good.
EXIT_STOPPED = 76
# The job's rendezvous endpoint (HOST:PORT), for its workers: `autohet node` sets it.
ENDPOINT_ENV = "AUTOHET_RENDEZVOUS"


class JobStopped(Exception):
    """The job stopped for good; the message says why (a worker's :func:`stop_for_good`)."""


def stop_for_good(line: str) -> int:
    """In a worker that stops the job for good: leave ``line`` (why, and which steps are
    complete where) in the job's rendezvous store, where every agent looks before it starts
    another round (the first worker's line stays); returns EXIT_STOPPED, the worker's status."""
    endpoint = os.environ.get(ENDPOINT_ENV)
    if endpoint:                        # else not under `autohet node`: nothing to tell
        host, port = endpoint.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
        store.compare_set(_stopped_key(os.environ["TORCHELASTIC_RUN_ID"]), "", line)
    return EXIT_STOPPED


def register(*, notice_file: str | None = None,
             stop_workers: Callable[[], None] | None = None) -> str:
    """Make ``--rdzv-backend autohet-c10d`` known to torchrun in this process; returns the name.
    ``notice_file``: this node's preemption-notice file (a preempt notice there: the node
    announces that it leaves); ``stop_workers``: ends this node's workers at once when a member
    of the round is lost."""
    _NODE.update(notice_file=notice_file, stop_workers=stop_workers)
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND


def close() -> None:
    """The job is over: close its rendezvous (through this process's newest handler)."""
    if _CREATED:
        _CREATED[-1].inner.set_closed()


_CREATED: list[PersistentRendezvous] = []       # an agent (re)started in this process: its own
_NODE: dict = {"notice_file": None, "stop_workers": None}      # register()'s, for new handlers


def _create_handler(params: RendezvousParameters) -> PersistentRendezvous:
    config = dict(params.config)
    loss_timeout = c10d_settings(config)
    c10d = RendezvousParameters("c10d", params.endpoint, params.run_id, params.min_nodes,
                                params.max_nodes, params.local_addr, **config)
    _CREATED.append(PersistentRendezvous(rendezvous_handler_registry.create_handler(c10d),
                                         loss_timeout_s=loss_timeout, **_NODE))
    return _CREATED[-1]


def c10d_settings(config: dict) -> float:
    """Turn the rendezvous settings' ``loss_timeout`` (seconds; default 20) into torch's
    keep-alive expiry, in ``config`` (elastic/liveness.py: torch drops a member one keep-alive
    interval after the agents confirmed it lost); returns the loss timeout. torch's
    ``keep_alive_interval`` is 1 s and its ``keep_alive_max_attempt`` derived: a setting that
    contradicts the loss timeout is refused."""
    loss_timeout = check_loss_timeout(float(config.pop("loss_timeout", DEFAULT_LOSS_TIMEOUT_S)),
                                      "loss_timeout", "rendezvous settings")
    attempts = expiry_attempts(loss_timeout)
    for key, wanted in (("keep_alive_interval", str(KEEP_ALIVE_INTERVAL_S)),
                        ("keep_alive_max_attempt", str(attempts))):
        if key in config and str(config[key]) != wanted:
            raise ValueError(f"rendezvous settings: {key}={config[key]} contradicts "
                             f"loss_timeout={loss_timeout:g} (which sets {key}={wanted}): "
                             "give loss_timeout alone")
        config[key] = wanted
    return loss_timeout


class PersistentRendezvous(RendezvousHandler):
    """torchrun's c10d handler ``inner``, whose ``next_rendezvous`` joins again after a failed
    round and whose ``num_nodes_waiting`` also counts the round's lost members (everything else
    is the inner handler's), confirmed over ``loss_timeout_s`` (elastic/liveness.py). Reads
    private attributes of torch's c10d handler (its state holder, node, store; torch 2.13)."""

    def __init__(self, inner: RendezvousHandler, *, notice_file: str | None = None,
                 stop_workers: Callable[[], None] | None = None,
                 loss_timeout_s: float = DEFAULT_LOSS_TIMEOUT_S):
        self.inner = inner
        self.keep_alives = KeepAlives(loss_timeout_s)
        _hold_last_call_for_fresh_joiners(inner, self.keep_alives, self._held_last_call)
        self.notice_file = notice_file
        self.stop_workers = stop_workers
        self.failed_rounds = 0
        self.lost_rounds = 0
        self.held_last_calls = 0        # rounds whose last call this agent held for joiners
        self._holding: int | None = None
        self._round: tuple[int, frozenset] | None = None    # (round, members) this agent runs
        self._departed: set = set()                         # members that announced it
        self._announced = False

    def next_rendezvous(self):
        self._end_if_stopped()
        while True:
            try:
                info = self.inner.next_rendezvous()
                state = self.inner._state_holder.state
                self._round = (state.round, frozenset(state.participants))
                return info
            except RendezvousClosedError:
                self._end_if_stopped()
                raise
            except RendezvousGracefulExitError as err:
                # A node beyond --nnodes' maximum finds the rendezvous closed: the same end as
                # any other (torchrun's agent returns no result for it, and its launcher fails
                # on that).
                self._end_if_stopped()
                raise RendezvousClosedError(str(err)) from err
            except (RendezvousTimeoutError, DistStoreError) as err:
                # The join timeout, or a store read that timed out: not the job's end.
                self.failed_rounds += 1
                said = str(err).strip().splitlines()
                print(f"autohet node: a rendezvous round failed ({type(err).__name__}"
                      + (f": {said[0]}" if said else "") + "); joining the next round",
                      file=sys.stderr, flush=True)

    def get_backend(self) -> str:
        return BACKEND              # torchrun checks that the handler is the one asked for

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self):
        return self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join whose keep-alive is fresh (torchrun's agent restarts its
        workers when > 0; it asks every monitor interval while they run), else the lost members
        of this agent's round, whose workers this ends first (``stop_workers``)."""
        self._announce_departure()
        # A fresh state, not one cached for a second: a join or a loss is seen 0.1 s later.
        self.inner._state_holder._last_sync_time = -1
        self.inner.num_nodes_waiting()          # syncs: torch's expired keep-alives drop out
        state = self.inner._state_holder.state
        self.keep_alives.observe(state.last_heartbeats, time.monotonic())
        waiting = sum(map(self.keep_alives.fresh, state.wait_list))
        if waiting:
            return waiting
        lost = self.lost_members()
        if not lost:
            return 0
        self.lost_rounds += 1
        print(f"autohet node: {len(lost)} member(s) of rendezvous round {self._round[0]} lost "
              f"without notice ({', '.join(sorted(map(repr, lost)))}; it left the round, or "
              f"its keep-alive was unchanged for the loss timeout of "
              f"{self.keep_alives.loss_timeout_s:g} s): ending this node's workers, joining the "
              "next round", file=sys.stderr, flush=True)
        self._round = None                              # reported once
        if self.stop_workers is not None:
            self.stop_workers()
        return len(lost)

    def _held_last_call(self, number: int, awaited: set) -> None:
        if self._holding != number:
            self.held_last_calls += 1
            self._holding = number
        print(f"autohet node: rendezvous round {number}'s last call waits for {len(awaited)} "
              f"node(s) waiting to join, alive by their keep-alive "
              f"({', '.join(sorted(map(repr, awaited)))}; at most "
              f"{self.keep_alives.loss_timeout_s:g} s, the loss timeout)",
              file=sys.stderr, flush=True)

    def lost_members(self) -> set:
        """The other members of this agent's round that left it, or whose keep-alive lapsed for
        the loss timeout as this agent saw it (:class:`KeepAlives`), and that had not announced
        their departure. Never this agent itself: its own lapse is no loss (it follows when the
        others leave the round)."""
        if self._round is None:
            return set()
        number, members = self._round
        others = members - {self.inner._this_node}
        state = self.inner._state_holder.state
        present = set(state.participants) if state.round == number else set()
        lost = (others - present) | self.keep_alives.lost(others & present)
        for member in lost - self._departed:
            if self.inner._store.check([_departure_key(self.get_run_id(), member)]):
                self._departed.add(member)
        return lost - self._departed

    def _announce_departure(self) -> None:
        """Once this node holds a preemption notice: tell the others, before its workers stop,
        that its agent's end will be no loss."""
        if self._announced or not self.notice_file or not preempt_notice_in(self.notice_file):
            return
        self.inner._store.set(_departure_key(self.get_run_id(), self.inner._this_node), "1")
        self._announced = True

    def _end_if_stopped(self) -> None:
        """JobStopped when a worker stopped the job for good (:func:`stop_for_good`), after
        closing the rendezvous for the nodes still waiting in it."""
        key = _stopped_key(self.get_run_id())
        if self.inner._store.check([key]):
            self.inner.set_closed()
            raise JobStopped(self.inner._store.get(key).decode())

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        # torchrun's handler would also close the rendezvous for every other agent; only its
        # keep-alive stops (a private method of torch's c10d handler, in 2.11-2.13 alike).
        self.inner._stop_heartbeats()
        return True


def _hold_last_call_for_fresh_joiners(inner: RendezvousHandler, keep_alives: KeepAlives,
                                      on_hold: Callable[[int, set], None]) -> None:
    """Make ``inner`` (torch's c10d handler) join its rounds with :class:`LastCallForFreshJoiners`
    instead of torch's join operation (the handler builds one per ``next_rendezvous`` and runs it
    through its operation executor: a private attribute of torch 2.13's handler)."""
    executor = inner._op_executor
    torch_run = executor.run

    def run(state_handler, deadline, update_deadline=None):
        if isinstance(state_handler, _RendezvousJoinOp):
            state_handler = LastCallForFreshJoiners(state_handler, keep_alives, on_hold)
        return torch_run(state_handler, deadline, update_deadline)
    executor.run = run


class LastCallForFreshJoiners:
    """torch's join operation ``torch_join``, except that a round's last call holds while a node
    of the wait list is fresh by ``keep_alives`` (read at every step of the join: each follows a
    read of the state), for at most the loss timeout past torch's deadline (module doc);
    ``on_hold(round, nodes)`` when it starts holding for nodes it had not held for."""

    def __init__(self, torch_join: _RendezvousJoinOp, keep_alives: KeepAlives,
                 on_hold: Callable[[int, set], None]):
        self.torch_join = torch_join
        self.keep_alives = keep_alives
        self.on_hold = on_hold
        self.held_for: set = set()

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        state = ctx.state
        self.keep_alives.observe(state.last_heartbeats, time.monotonic())
        action = self.torch_join(ctx, deadline)
        if action is not _Action.MARK_RENDEZVOUS_COMPLETE:
            return action
        bound = state.deadline + timedelta(seconds=self.keep_alives.loss_timeout_s)
        awaited = {node for node in state.wait_list if self.keep_alives.fresh(node)}
        if not awaited or datetime.now(timezone.utc) >= bound:
            return action
        if awaited - self.held_for:
            self.on_hold(state.round, awaited)
            self.held_for |= awaited
        return _Action.KEEP_ALIVE if _should_keep_alive(ctx) else _Action.SYNC


def _stopped_key(run_id: str) -> str:
    return f"autohet.stopped.{run_id}"


def _departure_key(run_id: str, node) -> str:
    return f"autohet.departed.{run_id}.{node!r}"
