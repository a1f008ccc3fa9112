"""`autohet node` after a round that failed once it had completed: a member of the round died
before the agents assigned their workers' ranks, so torchrun's agent times out reading its entry
(DistStoreError, after the store's read timeout of 60 s), outside any rendezvous handler.
`autohet node` starts its agent again, which joins the next round, where torchrun's launcher
would have ended the node with status 1. A real `autohet node` (torchrun's agent) and a member
that joins the round and then does nothing (a c10d handler in this process)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from helpers.fleets import CLUSTER, MODEL, make_plan
from megatron_autohet.elastic.rendezvous import close, register

pytestmark = pytest.mark.e2e


def test_a_round_that_fails_after_it_completed_is_followed_by_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")       # as `autohet node`
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                          wait_for_workers=False)
    # The silent member sorts after the node (127.0.0.2 > 127.0.0.1): the node is the round's
    # rank 0, publishes the workers' store, then waits for the member's entry.
    silent = rendezvous_handler_registry.create_handler(RendezvousParameters(
        register(), f"127.0.0.1:{store.port}", "job1", 2, 2, "127.0.0.2", is_host="false",
        last_call_timeout="1", loss_timeout="4"))
    joined = threading.Thread(target=silent.next_rendezvous, daemon=True)
    joined.start()
    log = tmp_path / "node.log"
    node = subprocess.Popen(
        [sys.executable, "-m", "megatron_autohet.cli.main", "node", "--rendezvous",
         f"127.0.0.1:{store.port}", "--job-id", "job1", "--nnodes", "2:2", "--node-name", "n1",
         "--gpu", "A100-80GB", "--local-addr", "127.0.0.1", "--cold-workers",
         "--loss-timeout", "4", "--",
         "--plan", str(make_plan(tmp_path)), "--model", str(MODEL), "--cluster", str(CLUSTER),
         "--autohet-local-ckpt-dir", str(tmp_path / "{node}"), "--save-interval", "10"],
        stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    try:
        def until(what, predicate):
            deadline = time.monotonic() + 600                # a safety net, not a measurement
            while not predicate():
                assert node.poll() is None, (f"autohet node exited with {node.returncode} "
                                             f"before {what}:\n{log.read_text()[-3000:]}")
                assert time.monotonic() < deadline, f"no {what}:\n{log.read_text()[-3000:]}"
                time.sleep(0.2)

        until("the failed round", lambda: "failed after it completed (DistStoreError" in
              log.read_text())
        silent.shutdown()                       # the member's keep-alive stops: it is gone

        def waiting_in_the_next_round():
            found = C10dRendezvousBackend(store, "job1").get_state()
            state = pickle.loads(found[0]) if found else None
            return state is not None and state.round >= 1 and any(
                n.addr == "127.0.0.1" for n in state.participants)
        until("the node in the next round", waiting_in_the_next_round)
        close()                                 # the job is over: the node ends with status 0
        assert node.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    assert "the job's rendezvous is closed: the job has ended" in log.read_text()
