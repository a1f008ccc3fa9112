"""autohet node's rendezvous (megatron_autohet/elastic/rendezvous.py): an agent whose round
fails joins the next one, where torchrun's own agent would exit and close the job's rendezvous."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from megatron_autohet.elastic.rendezvous import register

pytestmark = pytest.mark.integration


def test_an_agent_whose_round_timed_out_joins_the_next_one(monkeypatch):
    """A node alone where the job needs two waits past torchrun's join timeout (1 s here, 600 s
    by default): torchrun's c10d handler raises RendezvousTimeoutError (its agent would exit and
    close the job's rendezvous); autohet-c10d joins again, and the round completes when the
    second node comes. Real handlers on a real store, the two nodes as two threads."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")       # as `autohet node`
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                           wait_for_workers=False)
    backend = register()

    def handler(addr: str):
        return rendezvous_handler_registry.create_handler(RendezvousParameters(
            backend, f"127.0.0.1:{server.port}", "job1", 2, 2, addr, is_host="false",
            join_timeout="1", last_call_timeout="1", keep_alive_interval="1",
            keep_alive_max_attempt="3"))

    first, second = handler("127.0.0.1"), handler("127.0.0.2")
    got = {}

    def join(name, h):
        try:
            got[name] = h.next_rendezvous()
        except Exception as err:          # noqa: BLE001 - the assertions show it
            got[name] = err

    waiting = threading.Thread(target=join, args=("first", first))
    waiting.start()
    deadline = time.monotonic() + 60               # a safety net, not a measurement
    while first.failed_rounds < 1 and "first" not in got and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "first" not in got, got["first"]      # it neither gave up nor got a round alone
    assert first.failed_rounds >= 1
    join("second", second)
    waiting.join(timeout=60)
    assert sorted((got[n].rank, got[n].world_size) for n in got) == [(0, 2), (1, 2)], got
    for h in (first, second):
        h.shutdown()
