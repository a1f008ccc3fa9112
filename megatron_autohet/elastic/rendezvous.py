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
drops out of the rendezvous within a few seconds, as a lost node does); `autohet node` closes it
(:func:`close`) when its workers finished the job, so nodes still waiting learn that the job is
over. A closed rendezvous ends the agent (RendezvousClosedError, also for a node waiting beyond
``--nnodes``' maximum): `autohet node` then exits 0.
"""

from __future__ import annotations

import sys

from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous import (RendezvousClosedError,
                                                  RendezvousGracefulExitError,
                                                  RendezvousHandler, RendezvousParameters,
                                                  RendezvousTimeoutError,
                                                  rendezvous_handler_registry)

BACKEND = "autohet-c10d"


def register() -> str:
    """Make ``--rdzv-backend autohet-c10d`` known to torchrun in this process; returns the name."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND


def close() -> None:
    """The job is over: close its rendezvous (through this process's newest handler)."""
    if _CREATED:
        _CREATED[-1].inner.set_closed()


_CREATED: list[PersistentRendezvous] = []       # an agent (re)started in this process: its own


def _create_handler(params: RendezvousParameters) -> PersistentRendezvous:
    c10d = RendezvousParameters("c10d", params.endpoint, params.run_id, params.min_nodes,
                                params.max_nodes, params.local_addr, **params.config)
    _CREATED.append(PersistentRendezvous(rendezvous_handler_registry.create_handler(c10d)))
    return _CREATED[-1]


class PersistentRendezvous(RendezvousHandler):
    """torchrun's c10d handler ``inner``, whose ``next_rendezvous`` joins again after a failed
    round (everything else is the inner handler's)."""

    def __init__(self, inner: RendezvousHandler):
        self.inner = inner
        self.failed_rounds = 0

    def next_rendezvous(self):
        while True:
            try:
                return self.inner.next_rendezvous()
            except RendezvousGracefulExitError as err:
                # A node beyond --nnodes' maximum finds the rendezvous closed: the same end as
                # any other (torchrun's agent returns no result for it, and its launcher fails
                # on that).
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
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        # torchrun's handler would also close the rendezvous for every other agent; only its
        # keep-alive stops (a private method of torch's c10d handler, in 2.11-2.13 alike).
        self.inner._stop_heartbeats()
        return True
