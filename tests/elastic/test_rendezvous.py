"""autohet node's rendezvous (megatron_autohet/elastic/rendezvous.py): an agent whose round
fails joins the next one, and an agent that ends leaves the rendezvous open, where torchrun's
own agent would exit and close the job's rendezvous for every other agent. Real c10d handlers on
a real store, each node a thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from megatron_autohet.elastic.rendezvous import close, register

pytestmark = pytest.mark.integration


@pytest.fixture
def make_handler(monkeypatch):
    """``make_handler(addr)``: an autohet-c10d handler of a 2-node job (join timeout 1 s)."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")       # as `autohet node`
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                           wait_for_workers=False)
    backend = register()

    def make(addr: str):
        return rendezvous_handler_registry.create_handler(RendezvousParameters(
            backend, f"127.0.0.1:{server.port}", "job1", 2, 2, addr, is_host="false",
            join_timeout="1", last_call_timeout="1", keep_alive_interval="1",
            keep_alive_max_attempt="3"))
    return make


def join(got: dict, name: str, handler) -> None:
    try:
        got[name] = handler.next_rendezvous()
    except Exception as err:          # noqa: BLE001 - the assertions show it
        got[name] = err


def test_an_agent_whose_round_timed_out_joins_the_next_one(make_handler):
    """A node alone where the job needs two waits past torchrun's join timeout (1 s here, 600 s
    by default): torchrun's c10d handler raises RendezvousTimeoutError (its agent would exit and
    close the job's rendezvous); autohet-c10d joins again, and the round completes when the
    second node comes."""
    first, second = make_handler("127.0.0.1"), make_handler("127.0.0.2")
    got = {}
    waiting = threading.Thread(target=join, args=(got, "first", first))
    waiting.start()
    deadline = time.monotonic() + 60               # a safety net, not a measurement
    while first.failed_rounds < 1 and "first" not in got and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "first" not in got, got["first"]      # it neither gave up nor got a round alone
    assert first.failed_rounds >= 1
    join(got, "second", second)
    waiting.join(timeout=60)
    assert sorted((got[n].rank, got[n].world_size) for n in got) == [(0, 2), (1, 2)], got
    for handler in (first, second):
        handler.shutdown()                      # their keep-alive threads


def test_an_agent_that_ends_leaves_the_rendezvous_open_until_the_job_is_over(make_handler):
    """torchrun's agent shuts its handler down on its way out whatever the reason (a failed
    round, a failure of its own); only `autohet node` whose workers finished the job closes the
    rendezvous, which a node still waiting then finds closed."""
    first, second = make_handler("127.0.0.1"), make_handler("127.0.0.2")
    got = {}
    both = [threading.Thread(target=join, args=(got, n, h))
            for n, h in (("first", first), ("second", second))]
    for thread in both:
        thread.start()
    for thread in both:
        thread.join(timeout=60)
    assert sorted(got[n].world_size for n in got) == [2, 2], got
    first.shutdown()                            # an agent that ended
    # what a node finds that asks now (a fresh handler: the others cache the state for 1 s)
    assert not make_handler("127.0.0.3").is_closed()
    close()                                     # `autohet node`: the job is over
    assert make_handler("127.0.0.3").is_closed()
    second.shutdown()
