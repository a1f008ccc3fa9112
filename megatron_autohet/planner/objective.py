"""What a plan is chosen for: the planner's objectives, one class each.

An objective answers every question the planner asks about what it optimises: what plans are
ranked by (:meth:`Objective.score`, then the iteration time: :meth:`Objective.rank`), whether a
plan meets it (:meth:`Objective.meets`: a throughput floor), which search finds its plan
(:meth:`Objective.search`) and how a re-plan asks for it (:meth:`Objective.replan_search`), how
the plan file records it (:meth:`Objective.record`, read back by :func:`objective_of`) and how
the prediction states it (:meth:`Objective.describe`). The entry points (search.py), the warm-up
pass (warmup.py, handed :meth:`Objective.rank`), the re-planner (replan.py), the CLI and the
exhaustive oracle (testing/exhaustive.py) ask the objective and never compare its name.

* :class:`Throughput` (the default): the shortest iteration, by the throughput search
  (throughput_search.py).
* :class:`Cost`: the fewest USD per million tokens among the plans reaching a throughput floor
  (``min_tokens_per_s``; None: none, the degenerate cheapest plan), by the cost search
  (cost_search.py), within ``max_searches`` throughput searches. The price is the cost model's
  ``usd_per_million_tokens``: the GPUs' rate and, on a fleet across zones, the egress of the
  bytes crossing them (cost_model.py, "Zones").

Adding one: its class, registered in :data:`OBJECTIVES`, its name in plan.py's OBJECTIVES (the
plan file's vocabulary, which plan.py validates and the CLI offers without importing the
planner: tests/planner/test_planner_objective.py checks that the two agree), and its tests.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from megatron_autohet.cost_model import PlanCost
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Plan
from megatron_autohet.planner.candidate import Candidate
from megatron_autohet.planner.cost_search import FloorNotMet, check_prices, cheapest
from megatron_autohet.planner.throughput_search import fastest_before
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.model import ModelSpec

# The cost objective's budget of throughput searches in a re-plan (replan.py, "The
# objective"): with the cost search's default (cost_search.MAX_NODE_SETS, 24 node sets) a
# re-plan on 1024 GPUs took 3.9-10.2 CPU-s; with 4, 0.5-0.6, the plans at most 0.3% dearer per
# token (docs/planner.md).
REPLAN_COST_SEARCHES = 4


class ObjectiveNotKept(Exception):
    """The fleet now present cannot keep the plan's objective; the message says why and what
    the re-plan does instead (replan.py plans the fastest plan then)."""


@dataclass(frozen=True)
class Objective(ABC):
    """What a plan is chosen for (module doc); frozen: an objective is a value."""

    name: ClassVar[str]               # the plan file's ``objective``, the CLI's --objective
    takes_floor: ClassVar[bool] = False  # a throughput floor (min_tokens_per_s) applies
    priced: ClassVar[bool] = False    # ranks plans by price: every node needs a spot price

    @classmethod
    @abstractmethod
    def from_arguments(cls, min_tokens_per_s: float | None = None,
                       max_searches: int | None = None) -> Objective:
        """The objective search.search()'s arguments ask for; ConfigError on an argument it
        does not take or a value out of range."""

    @abstractmethod
    def score(self, cost: PlanCost) -> float:
        """What plans are ranked by: the smaller, the better."""

    def rank(self, cost: PlanCost) -> tuple[float, float]:
        """The score, ties to the shorter iteration (the warm-up pass's comparison)."""
        return self.score(cost), cost.iteration_time_s

    def meets(self, cost: PlanCost) -> bool:
        """Whether a plan of this cost may be chosen at all (a floor it must reach)."""
        return True

    @abstractmethod
    def search(self, cluster: Cluster, model: ModelSpec, profile: Profile | None,
               global_batch_size: int, micro_batch_size: int, seq_length: int | None,
               deadline: float, **options) -> Candidate:
        """The search that finds this objective's plan (search.search()'s ``options``, its
        safety net a ``deadline`` on candidate.clock())."""

    def arguments(self) -> dict:
        """search.search()'s arguments that ask for this objective."""
        return {"objective": self.name}

    def replan_search(self, cluster: Cluster, cluster_file: str,
                      search: Callable[..., Candidate]) -> Candidate:
        """The re-plan's search on ``cluster`` (``search``: search.search() with the re-plan's
        other arguments); ObjectiveNotKept when the fleet cannot keep the objective."""
        return search(**self.arguments())

    @classmethod
    def recorded(cls, plan: Plan) -> Objective:
        """The objective as ``plan`` records it (:meth:`record`)."""
        return cls()

    def record(self, plan: Plan) -> None:
        """Record the objective in the plan file, for its re-plans."""
        plan.objective, plan.min_tokens_per_s = self.name, None

    def describe(self, predicted: dict) -> str | None:
        """The prediction's line about the objective, given the plan's predictions (None: the
        default goes without saying)."""
        return None


@dataclass(frozen=True)
class Throughput(Objective):
    """The shortest iteration."""

    name: ClassVar[str] = "throughput"

    @classmethod
    def from_arguments(cls, min_tokens_per_s: float | None = None,
                       max_searches: int | None = None) -> Throughput:
        if min_tokens_per_s is not None:
            raise _floor_refused(min_tokens_per_s, cls.name)
        if max_searches is not None:
            raise _budget_refused(max_searches, cls.name)
        return cls()

    def score(self, cost: PlanCost) -> float:
        return cost.iteration_time_s

    def search(self, cluster: Cluster, model: ModelSpec, profile: Profile | None,
               global_batch_size: int, micro_batch_size: int, seq_length: int | None,
               deadline: float, **options) -> Candidate:
        return fastest_before(cluster, model, profile, global_batch_size, micro_batch_size,
                              seq_length, deadline, **options)


@dataclass(frozen=True)
class Cost(Objective):
    """The fewest USD per million tokens among the plans reaching ``min_tokens_per_s`` (None:
    no floor), within ``max_searches`` throughput searches (None: cost_search's default)."""

    name: ClassVar[str] = "cost"
    takes_floor: ClassVar[bool] = True
    priced: ClassVar[bool] = True
    min_tokens_per_s: float | None = None
    max_searches: int | None = None

    @classmethod
    def from_arguments(cls, min_tokens_per_s: float | None = None,
                       max_searches: int | None = None) -> Cost:
        if min_tokens_per_s is not None and not 0 < min_tokens_per_s < math.inf:
            raise _floor_refused(min_tokens_per_s, cls.name)
        if max_searches is not None and not max_searches >= 1:
            raise _budget_refused(max_searches, cls.name)
        return cls(min_tokens_per_s, max_searches)

    def score(self, cost: PlanCost) -> float:
        return cost.usd_per_million_tokens

    def meets(self, cost: PlanCost) -> bool:
        return cost.tokens_per_s >= (self.min_tokens_per_s or 0.0)

    def search(self, cluster: Cluster, model: ModelSpec, profile: Profile | None,
               global_batch_size: int, micro_batch_size: int, seq_length: int | None,
               deadline: float, **options) -> Candidate:
        return cheapest(cluster, model, profile, global_batch_size, micro_batch_size, seq_length,
                        deadline=deadline, min_tokens_per_s=self.min_tokens_per_s,
                        max_searches=self.max_searches, rank=self.rank, **options)

    def arguments(self) -> dict:
        return {"objective": self.name, "min_tokens_per_s": self.min_tokens_per_s,
                "max_searches": self.max_searches}

    def replan_search(self, cluster: Cluster, cluster_file: str,
                      search: Callable[..., Candidate]) -> Candidate:
        """The cost search within REPLAN_COST_SEARCHES throughput searches (replan.py, "The
        objective"); not kept where a node has no price or no plan reaches the floor."""
        try:
            check_prices(cluster, cluster_file, f"the plan's objective {self.name}")
        except ConfigError as exc:
            raise _not_kept(exc.problem) from exc
        try:
            return search(**dataclasses.replace(
                self, max_searches=REPLAN_COST_SEARCHES).arguments())
        except FloorNotMet as exc:
            raise _not_kept(f"no plan on the fleet present reaches the plan's floor of "
                            f"{self.min_tokens_per_s:,.0f} tokens/s (the fastest: "
                            f"{exc.fastest_tokens_per_s:,.0f})") from exc

    @classmethod
    def recorded(cls, plan: Plan) -> Cost:
        return cls(plan.min_tokens_per_s)

    def record(self, plan: Plan) -> None:
        plan.objective, plan.min_tokens_per_s = self.name, self.min_tokens_per_s

    def describe(self, predicted: dict) -> str | None:
        line = "the fewest USD per million tokens"
        if self.min_tokens_per_s is not None:
            line += f" at {self.min_tokens_per_s:,.0f} tokens/s or more"
            # (the predicted figure is rounded to 0.1 tokens/s)
            if predicted["tokens_per_s"] < self.min_tokens_per_s - 0.05:
                line += " (NOT REACHED by this plan)"
        return line


# The objectives by name, the default first.
OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (Throughput, Cost)}
THROUGHPUT = Throughput()


def objective_named(name: str) -> type[Objective]:
    """The objective of this name (search.search()'s ``objective``); ConfigError when none is."""
    if name not in OBJECTIVES:
        raise ConfigError("<arguments>", "objective", f"got {name!r}", ", ".join(OBJECTIVES))
    return OBJECTIVES[name]


def objective_of(plan: Plan) -> Objective:
    """The objective the plan file records (plan.py has validated its name)."""
    return OBJECTIVES[plan.objective].recorded(plan)


def _floor_refused(value: float, name: str) -> ConfigError:
    floored = " or ".join(map(repr, floor_objectives()))
    return ConfigError("<arguments>", "min_tokens_per_s", f"got {value} with objective {name!r}",
                       f"a finite number > 0, with objective {floored} (the throughput "
                       "objective is as fast as it gets)")


def _budget_refused(value: int, name: str) -> ConfigError:
    return ConfigError("<arguments>", "max_searches", f"got {value} with objective {name!r}",
                       f"an integer >= 1, with objective {Cost.name!r}")


def floor_objectives() -> list[str]:
    """The names of the objectives that take a throughput floor."""
    return [name for name, kind in OBJECTIVES.items() if kind.takes_floor]


def _not_kept(why: str) -> ObjectiveNotKept:
    return ObjectiveNotKept(f"{why}: the fastest plan instead of the cheapest")
