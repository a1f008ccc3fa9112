"""autohet node's rendezvous (megatron_autohet/elastic/rendezvous.py): an agent whose round
fails joins the next one, and an agent that ends leaves the rendezvous open, where torchrun's
own agent would exit and close the job's rendezvous for every other agent; a member of the
round lost without notice is seen by the others (its workers' peers are ended), one that
announced its departure after a preemption notice is not, nor one whose keep-alive lapsed for
less than the loss timeout, nor an agent's own lapse. Real c10d handlers on a real store, each
node a thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from megatron_autohet.elastic.notices import Notice, write_notice
from helpers.dist_utils import LoadClock
from megatron_autohet.elastic.rendezvous import close, register

pytestmark = pytest.mark.integration


@pytest.fixture
def make_handler(monkeypatch):
    """``make_handler(addr, loss_timeout="4", min_nodes=2, join_timeout="1")``: an autohet-c10d
    handler of a job of ``min_nodes``-2 nodes (last call 1 s, as `autohet node`'s; loss timeout
    4 s, the shortest allowed; a join timeout of 1 s: torch's comes before its last call)."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")       # as `autohet node`
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                           wait_for_workers=False)
    backend = register()
    made = []

    def make(addr: str, loss_timeout: str = "4", min_nodes: int = 2, join_timeout: str = "1"):
        made.append(rendezvous_handler_registry.create_handler(RendezvousParameters(
            backend, f"127.0.0.1:{server.port}", "job1", min_nodes, 2, addr, is_host="false",
            join_timeout=join_timeout, last_call_timeout="1", loss_timeout=loss_timeout)))
        return made[-1]
    yield make
    for handler in made:        # their keep-alive threads end before the store does
        handler.shutdown()


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
    first, second = a_round_of_two(make_handler)
    first.shutdown()                            # an agent that ended
    # what a node finds that asks now (a fresh handler: the others cache the state for 1 s)
    assert not make_handler("127.0.0.3").is_closed()
    close()                                     # `autohet node`: the job is over
    assert make_handler("127.0.0.3").is_closed()
    second.shutdown()


def a_round_of_two(make_handler, **settings):
    first, second = make_handler("127.0.0.1", **settings), make_handler("127.0.0.2", **settings)
    got = {}
    both = [threading.Thread(target=join, args=(got, n, h))
            for n, h in (("first", first), ("second", second))]
    for thread in both:
        thread.start()
    for thread in both:
        thread.join(timeout=60)
    assert sorted(got[n].world_size for n in got) == [2, 2], got
    return first, second


def until_gone(watcher, member) -> list[int]:
    """``watcher.num_nodes_waiting()`` as torchrun's agent calls it (every monitor interval)
    until the call that finds ``member`` out of the round (torch's keep-alive expiry, one second
    after the loss timeout) or lost; every answer, in order."""
    answers = []
    clock = LoadClock()                             # a safety net, not a measurement
    while True:
        answers.append(watcher.num_nodes_waiting())
        if answers[-1] or member not in watcher.inner._state_holder.state.participants:
            return answers
        assert clock.seconds() < 120, f"{member} still in the round"
        time.sleep(0.1)


def polled_for(watcher, seconds: float) -> list[int]:
    """``watcher.num_nodes_waiting()`` every 0.1 s for ``seconds``; every answer."""
    answers, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        answers.append(watcher.num_nodes_waiting())
        time.sleep(0.1)
    return answers


def test_a_member_lost_without_notice_ends_the_others_workers(make_handler):
    """A node whose processes are killed (or whose network is cut) stops its keep-alive; its
    peers' workers wait in a collective with its workers. Every other agent sees the member
    drop out of the round, ends its own workers (stop_workers) and tells torchrun's agent to
    restart them (num_nodes_waiting > 0) - torchrun's handler reports nothing (no node waits
    to join) and the workers wait for the process group's timeout."""
    first, second = a_round_of_two(make_handler)
    ended = []
    first.stop_workers = lambda: ended.append(time.monotonic())
    assert first.num_nodes_waiting() == 0 and not ended          # everyone is there
    lost = second.inner._this_node
    second.shutdown()                           # killed: no more keep-alive
    answers = until_gone(first, lost)
    # 1: the lost member (never this agent itself, whatever its own keep-alive did meanwhile)
    assert answers[-1] == 1 and not any(answers[:-1]), answers
    assert len(ended) == 1 and first.lost_rounds == 1
    first.shutdown()


def test_a_member_whose_keep_alive_lapses_for_less_than_the_loss_timeout_is_not_lost(
        make_handler):
    """A live node that gets no CPU for a while sends no keep-alive meanwhile: 5 s here, where
    the old 3 s expiry declared it lost (and torch's c10d dropped it from the round); with a loss
    timeout of 15 s it stays a member, and so does an agent whose own keep-alive lapsed as long.
    Once it is silent for the loss timeout, it is lost."""
    first, second = a_round_of_two(make_handler, loss_timeout="15")
    ended = []
    first.stop_workers = lambda: ended.append(time.monotonic())
    member = second.inner._this_node
    second.inner._stop_heartbeats()             # busy: no keep-alive ...
    first.inner._stop_heartbeats()              # ... and this agent's own neither
    answers = polled_for(first, 5)
    second.inner._start_heartbeats()            # ... for 5 s, then both alive again
    first.inner._start_heartbeats()
    answers += polled_for(first, 3)
    state = first.inner._state_holder.state
    assert not any(answers) and not ended and first.lost_rounds == 0, answers
    assert set(state.participants) == {first.inner._this_node, member}
    second.shutdown()                           # now lost for good
    answers = until_gone(first, member)
    assert answers[-1] == 1 and len(ended) == 1 and first.lost_rounds == 1
    first.shutdown()


def test_a_member_that_announced_its_departure_is_not_lost(tmp_path, make_handler):
    """A node with a preemption notice announces that it leaves (before its workers stop); the
    others re-plan in-process and train on, so its agent's end later is no loss."""
    first, second = a_round_of_two(make_handler)
    ended = []
    first.stop_workers = lambda: ended.append(time.monotonic())
    second.notice_file = str(tmp_path / "notice.json")
    write_notice(second.notice_file, Notice("signal", "rebalance", None, time.time()))
    assert second.num_nodes_waiting() == 0      # a rebalance recommendation: nothing announced
    write_notice(second.notice_file, Notice("signal", "preempt", None, time.time()))
    assert second.num_nodes_waiting() == 0      # announced
    gone = second.inner._this_node
    second.shutdown()                           # the machine goes after the workers left
    assert set(until_gone(first, gone)) == {0}
    assert not ended and first.lost_rounds == 0
    first.shutdown()


def paused_once_waiting(handler, resume: threading.Event) -> None:
    """``handler``'s agent gets no CPU once it is in the wait list: its reads of the state (and
    with them its keep-alives, which it writes at a read) wait for ``resume`` - what an agent
    of a loaded host does for 5-15 s at a time, made deterministic."""
    holder = handler.inner._state_holder
    torch_sync = holder.sync

    def sync():
        if not holder._dirty and handler.inner._this_node in holder.state.wait_list:
            resume.wait()
        return torch_sync()
    holder.sync = sync


def a_round_with_a_late_joiner(make_handler, loss_timeout: str):
    """``first`` trains alone (``--nnodes 1:2``); ``second`` arrives, adds itself to the wait
    list and then gets no CPU (:func:`paused_once_waiting`); ``first``'s agent sees it waiting
    (num_nodes_waiting > 0, as torchrun's agent polls it) and starts the next round. Returns the
    handlers, ``resume``, the joins' results and their threads."""
    first, second = (make_handler(addr, loss_timeout=loss_timeout, min_nodes=1,
                                  join_timeout="600") for addr in ("127.0.0.1", "127.0.0.2"))
    got = {}
    join(got, "alone", first)
    assert got["alone"].world_size == 1, got
    resume = threading.Event()
    paused_once_waiting(second, resume)
    threads = [threading.Thread(target=join, args=(got, "second", second), daemon=True)]
    threads[0].start()
    clock = LoadClock()                             # a safety net, not a measurement
    while not first.num_nodes_waiting():
        assert clock.seconds() < 120, "the second node never waited"
        time.sleep(0.1)
    threads.append(threading.Thread(target=join, args=(got, "first", first), daemon=True))
    threads[1].start()
    return first, second, resume, got, threads


def test_the_last_call_waits_for_a_waiting_node_whose_keep_alive_is_late(make_handler):
    """torch's round completes 1 s after its first member (the last call), whoever joined by
    then: a waiting agent that reads the state only every 5-15 s (a loaded host) misses the
    round that was opened to admit it, the agents restart for it again, and so on - no worker
    trains. The last call holds while a waiting node's keep-alive was seen changing within the
    loss timeout: the round completes with both once the late node reads the state."""
    first, second, resume, got, threads = a_round_with_a_late_joiner(make_handler, "60")
    clock = LoadClock()                             # a safety net, not a measurement
    while "first" not in got and not first.held_last_calls:
        assert clock.seconds() < 120, "the round neither completed nor held its last call"
        time.sleep(0.05)
    # decided before the paused node reads the state again: alone here is the livelock's round
    assert "first" not in got, got["first"].world_size
    resume.set()                                    # the late node gets the CPU again
    for thread in threads:
        thread.join(timeout=120)
    assert sorted((got[n].rank, got[n].world_size) for n in ("first", "second")) == [
        (0, 2), (1, 2)], got
    assert first.held_last_calls == 1
    for handler in (first, second):
        handler.shutdown()


def test_a_waiting_node_that_died_holds_the_last_call_for_the_loss_timeout_at_most(
        make_handler):
    """A standby that dies while it waits stays fresh until its keep-alive is the loss timeout
    old: the last call holds for it that long at most, then the round completes without it."""
    first, second, resume, got, threads = a_round_with_a_late_joiner(make_handler, "15")
    threads[1].join(timeout=120)                    # a safety net: the bound ends the hold
    assert got["first"].world_size == 1, got
    assert first.held_last_calls == 1
    assert second.inner._this_node in first.inner._state_holder.state.wait_list
    first.shutdown()
    resume.set()
    close()                                         # the job is over: the paused node ends
    threads[0].join(timeout=120)
    assert isinstance(got["second"], Exception), got
    second.shutdown()
