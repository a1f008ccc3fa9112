"""When a member's lapsed keep-alive is a loss (megatron_autohet/elastic/liveness.py): the
confirmation rule on keep-alives and poll times fed by hand, torch's expiry derived from the loss
timeout, and the refusals of a bad timeout."""

from __future__ import annotations

import pytest

from megatron_autohet.elastic.liveness import (CONFIRM_POLLS, CONFIRM_S, KeepAlives,
                                               check_loss_timeout, expiry_attempts, rdzv_conf)
from megatron_autohet.elastic.rendezvous import c10d_settings
from megatron_autohet.errors import ConfigError

pytestmark = pytest.mark.unit

TIMEOUT = 20.0


def polls(watch: KeepAlives, values: dict, start: float, end: float, every: float = 0.1):
    """``watch.observe(values)`` every ``every`` seconds from ``start`` to ``end``."""
    t = start
    while t <= end + 1e-9:
        watch.observe(values, t)
        t += every


def test_a_member_silent_for_the_timeout_at_every_poll_is_lost_and_not_before():
    watch = KeepAlives(TIMEOUT)
    polls(watch, {"a": 1, "b": 1}, 0.0, TIMEOUT - 0.2)
    assert watch.lost({"a", "b"}) == set()
    polls(watch, {"a": 1, "b": 1}, TIMEOUT - 0.1, TIMEOUT + 0.1)
    assert watch.lost({"a", "b"}) == {"a", "b"}
    assert watch.lost({"a"}) == {"a"}                   # only the members asked about


def test_a_keep_alive_that_changes_before_confirmation_starts_again_from_zero():
    watch = KeepAlives(TIMEOUT)
    polls(watch, {"a": 1}, 0.0, TIMEOUT - 0.5)          # overdue, not yet confirmed
    polls(watch, {"a": 2}, TIMEOUT - 0.4, TIMEOUT + 5)  # it wrote again: alive
    assert watch.lost({"a"}) == set()
    polls(watch, {"a": 2}, TIMEOUT + 5.1, 2 * TIMEOUT - 0.5)
    assert watch.lost({"a"}) == set()                   # silent since TIMEOUT - 0.4 only
    polls(watch, {"a": 2}, 2 * TIMEOUT - 0.4, 2 * TIMEOUT)
    assert watch.lost({"a"}) == {"a"}


def test_an_agent_that_got_no_cpu_itself_gives_the_members_time_to_show_they_live():
    """The agent's own polls stop for longer than the timeout: at its next poll every
    keep-alive looks old, but none is lost until it saw them overdue over the confirmation
    window at several polls; members that are alive wrote meanwhile."""
    watch = KeepAlives(TIMEOUT)
    watch.observe({"a": 1, "b": 1}, 0.0)
    watch.observe({"a": 1, "b": 1}, 3 * TIMEOUT)        # back after a long gap
    assert watch.lost({"a", "b"}) == set()
    watch.observe({"a": 2, "b": 1}, 3 * TIMEOUT + 1)    # a is alive; b is not
    watch.observe({"a": 2, "b": 1}, 3 * TIMEOUT + CONFIRM_S)
    assert watch.lost({"a", "b"}) == {"b"}


def test_confirmation_needs_several_polls_not_only_time():
    watch = KeepAlives(TIMEOUT)
    watch.observe({"a": 1}, 0.0)
    watch.observe({"a": 1}, TIMEOUT - CONFIRM_S)        # overdue: poll 1
    watch.observe({"a": 1}, TIMEOUT + 1)                # poll 2, past the timeout
    assert CONFIRM_POLLS == 3 and watch.lost({"a"}) == set()
    watch.observe({"a": 1}, TIMEOUT + 1.1)              # poll 3
    assert watch.lost({"a"}) == {"a"}


def test_a_node_out_of_the_state_is_forgotten_and_unknown_members_are_not_lost():
    watch = KeepAlives(TIMEOUT)
    polls(watch, {"a": 1}, 0.0, TIMEOUT + 1)
    watch.observe({}, TIMEOUT + 1.1)                    # torch removed it from the state
    assert watch.lost({"a", "z"}) == set()
    assert KeepAlives(TIMEOUT).lost({"a"}) == set()     # no poll yet


def test_a_waiting_node_is_fresh_while_its_keep_alive_changes_within_the_loss_timeout():
    """A waiting agent on a loaded host writes its keep-alive every 5-15 s; it counts (the
    agents restart to admit it, the next round's last call waits for it) until it lapsed for
    the loss timeout, as a member would."""
    watch = KeepAlives(TIMEOUT)
    watch.observe({"w": 1}, 0.0)
    assert watch.fresh("w") and not watch.fresh("x")
    watch.observe({"w": 1}, 15.0)                       # busy, not dead
    assert watch.fresh("w")
    watch.observe({"w": 1}, TIMEOUT + 0.1)              # a standby that died waiting
    assert not watch.fresh("w")
    watch.observe({"w": 2}, TIMEOUT + 5)
    assert watch.fresh("w")


def test_torch_expiry_is_one_interval_after_the_loss_timeout():
    assert expiry_attempts(20) == 21 and expiry_attempts(4.5) == 6
    assert rdzv_conf(20) == ("is_host=false,last_call_timeout=1,keep_alive_interval=1,"
                             "loss_timeout=20")
    config = {"is_host": "false", "loss_timeout": "7.5"}
    assert c10d_settings(config) == 7.5
    assert config == {"is_host": "false", "keep_alive_interval": "1",
                      "keep_alive_max_attempt": "9"}
    config = {}
    assert c10d_settings(config) == 20.0 and config["keep_alive_max_attempt"] == "21"
    with pytest.raises(ValueError, match="keep_alive_max_attempt=3 contradicts loss_timeout=20"):
        c10d_settings({"keep_alive_max_attempt": "3"})


@pytest.mark.parametrize("value,problem", [(0, "got 0"), (-5, "got -5"), (3.9, "got 3.9"),
                                           (float("nan"), "got nan, not a finite number"),
                                           (float("inf"), "got inf, not a finite number")])
def test_a_bad_loss_timeout_is_refused_naming_the_flag(value, problem):
    with pytest.raises(ConfigError) as err:
        check_loss_timeout(value)
    assert str(err.value).startswith(f"<command line>: field '--loss-timeout': {problem}")
    assert check_loss_timeout(4) == 4
