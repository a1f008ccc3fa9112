"""The warm-up pass's shortcuts change no result: its makespan floor is a true lower bound of
every 1F1B order the simulation plays, and the greedy depths are the same with the floor's early
stop as without it."""

from __future__ import annotations

import random

import pytest

from megatron_autohet.cost_model import StageCost, simulate_1f1b
from megatron_autohet.plan import standard_warmup_depths
from megatron_autohet.planner import warmup

pytestmark = pytest.mark.unit


def random_pipeline(rng: random.Random) -> tuple[list[StageCost], int]:
    stages = rng.randint(2, 6)
    out = []
    for s in range(stages):
        forward = rng.choice([1.0, 0.5, rng.uniform(0.1, 2.0)])
        # slow links now and then: where deeper warm-ups gain most
        p2p = rng.choice([0.0, rng.uniform(0.0, 0.3), rng.uniform(0.5, 3.0)])
        out.append(StageCost(0, s, "g", 1, (s, s + 1), forward, forward * rng.uniform(1.5, 3.0),
                             p2p, None, 1, 1, 1.0, 1.0, 0.0, 0.0))
    return out, rng.randint(1, 24)


def deeper(rng: random.Random, stages: int, m: int) -> list[int]:
    """Standard depths, or those of stages 0..b run ``extra`` ahead (the pass's steps)."""
    depths = standard_warmup_depths(stages, m)
    if rng.random() < 0.7:
        b, extra = rng.randrange(stages - 1), rng.choice([1, 2, 4, 8, m])
        depths = [min(w + extra, m) if s <= b else w for s, w in enumerate(depths)]
    return depths


def test_the_floor_is_below_every_simulated_schedule():
    rng = random.Random(7)
    for _ in range(400):
        stages, m = random_pipeline(rng)
        depths = deeper(rng, len(stages), m)
        assert warmup.makespan_floor(stages, m) <= simulate_1f1b(stages, m, depths, record=False)


def test_the_floor_is_reached_by_one_slow_stage_without_links():
    # the last stage sets the pace, links free: GPipe's order keeps it busy from its first
    # forward to its last backward, and the floor is that
    stages = [StageCost(0, s, "g", 1, (s, s + 1), f, 2 * f, 0.0, None, 1, 1, 1.0, 1.0, 0.0, 0.0)
              for s, f in enumerate((1.0, 1.0, 3.0))]
    m = 8
    assert warmup.makespan_floor(stages, m) == pytest.approx(1 + 1 + 8 * 9 + 2 + 2)
    assert simulate_1f1b(stages, m, [8, 8, 0], record=False) == pytest.approx(
        warmup.makespan_floor(stages, m))


def test_the_floors_early_stop_keeps_the_greedy_depths(monkeypatch):
    rng = random.Random(11)
    cases = []
    for _ in range(150):
        stages, m = random_pipeline(rng)
        caps = [rng.choice([m, m // 2, 1]) for _ in stages[:-1]] + [0]
        cases.append((stages, m, caps))
    warmup._best_warmups.cache_clear()
    with_floor = [warmup.best_warmups(stages, m, caps) for stages, m, caps in cases]
    warmup._best_warmups.cache_clear()
    monkeypatch.setattr(warmup, "makespan_floor", lambda stages, m: 0.0)
    without = [warmup.best_warmups(stages, m, caps) for stages, m, caps in cases]
    warmup._best_warmups.cache_clear()
    assert with_floor == without
    # the cases reach the floor's stop and deeper depths both
    assert any(d != standard_warmup_depths(len(c[0]), c[1]) for (d, _), c in zip(without, cases))
