"""Adaptive re-planning's decision: whether a running job should switch to a plan made for what
it measured (pure, torch-free; the switch itself is not here).

Every measurement window (runtime/stage_drift.py) gives each stage's measured time, hence a
profile of the GPU types the plan runs on (profiling/from_run.py ``profile_from_window``) and
the GPUs slower than the others of their type (``find_stragglers``, priced at their speed:
spec/cluster.py ``Cluster.speeds``). :meth:`Adapter.consider` re-plans the same fleet on them
(planner/replan.py ``replan`` with ``search_unchanged``: the types measured as measured, the
others estimated and calibrated by them, as the planner resolves any profile; the previous plan
is the derived seed, its micro-batches re-split; the re-plan's objective, the plan's) and prices
the switch:

* **Predicted gain**: ``(T_now - T_new) / T_now``, both plans priced by the cost model on the
  measured profile and speeds, in the objective's unit per iteration (seconds; the cost
  objective's USD).
* **Switch cost**: the state the new plan's ranks need from other nodes
  (planner/state_moves.py, as re-plans price it), at each node's NIC, the slowest node's time,
  plus the switch's fixed part: saving the state, rebuilding process groups, model and
  optimizer on the new layout, the recovery and the first iteration. Before the job has
  switched that is ``overhead_s`` (DEFAULT_SWITCH_OVERHEAD_S, a guess); after a switch, what
  that switch took beyond its own priced state moves (:meth:`Adapter.switch_measured`, from
  plan_switch.py's timing of it): the latest one's, as the closest to the next switch's
  conditions (the same processes, checkpoint tiers and load), not an average over switches of
  other plans. In seconds (the cost objective pays them at the current plan's rate).
* **Amortised gain**: ``(N (T_now - T_new) - switch) / (N T_now)`` over the ``N`` iterations
  left: a gain that does not pay the switch back before the job ends is declined.

The decision switches when the amortised gain is at least ``threshold`` (DEFAULT_THRESHOLD,
5%), with hysteresis: no switch within ``hold_windows`` windows of the last one (DEFAULT_HOLD;
those windows measure the new plan), and the gain must hold for two consecutive windows (one
noisy window does not move a job): the re-plan found on one window's measurements is priced
again, against the plan the job runs, on the next window's (:func:`confirm_window`, no search),
and its amortised gain there must pass the threshold too. A job takes a window's decision at
the next window's end (its search runs meanwhile, planner/adapt_process.py), so that next
window's measurements are there to confirm it on: a gain seen in windows 1 and 2 switches after
window 2, not after window 3 as a second search would. A steady fleet sees one correction:
after the switch the windows measure the new plan, the re-plan on them finds it again (or one
within the re-plan's tolerance that moves nothing), and the gain is nil. Each decision is an
:class:`AdaptDecision` (its console line and its elastic ``adapt`` event). A job in
``--autohet-adapt log`` mode counts a switch it would have made as made (:meth:`Adapter.judge`
starts the hold), so its log shows the decisions the job would take, one correction and its
hold, not the same advice every window.

The expensive part, the search, is :func:`replan_window` (a :class:`Replan`: the re-plan and
both plans priced; planner/adapt_process.py runs it in a process of its own, off the training's
critical path); :meth:`Adapter.decide` adds the switch's fixed cost, the amortisation and the
hysteresis, on the rank that decides, cheaply, and asks for the confirmation (two plans priced by
the cost model, no search) only where the gain qualifies. :meth:`Adapter.consider` is the search
and the decision in one call.

``plan_fleet(plan, catalog, template=None)``: the fleet a plan runs on, as a cluster (its nodes
and GPUs; links from ``template``, the job's cluster file where it has one, else the catalog's
intra-node figure and DEFAULT_NIC_GBS).
``switch_cost(previous, new, cluster, overhead_s)``: (seconds, bytes moved).
``amortised_gain(now, new, switch, remaining)``: the fraction above.
``replan_window(plan, stages, window, priors, ...)``: the search of a window's end
(``--autohet-adapt log`` and ``replan``, job.py): the stragglers and the measured profile of the
window (profiling/from_run.py), merged over the plan's recorded profile, the plan's fleet with
the measured speeds, re-planned and priced.
``confirm_window(plan, candidate, stages, window, priors, ...)``: the same window's figures for a
re-plan already found, priced without a search.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from megatron_autohet.cost_model import (PlanCost, evaluate_plan, plan_charge,
                                         plan_memory_headroom, plan_profile)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Plan
from megatron_autohet.planner.objective import THROUGHPUT, objective_of
from megatron_autohet.planner.replan import replan
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.planner.state_moves import recovery_bytes_by_node
from megatron_autohet.profiling.from_run import (Straggler, find_stragglers, measured_speeds,
                                                 profile_from_window)
from megatron_autohet.profiling.profile import Profile, merge_profiles
from megatron_autohet.spec.cluster import Cluster, Node
from megatron_autohet.spec.gpus import GPUType

DEFAULT_THRESHOLD = 0.05
DEFAULT_HOLD = 3
# The fixed part of a switch (module doc): a checkpoint of the state, new process groups, the
# model and optimizer built on the new layout, a first iteration; an elastic re-plan's restart
# measured 10-40 s on the emulated fleets (docs/spot.md): 30 s until the job's first switch is
# measured (Adapter.switch_measured).
DEFAULT_SWITCH_OVERHEAD_S = 30.0
# A plan's file does not record its links: the NIC of a fleet derived from a plan alone.
DEFAULT_NIC_GBS = 25.0
# --autohet-adapt: nothing; the decision logged every window; the switch made
# (plan_switch.train_adapting)
MODES = ("off", "log", "replan")
DEFAULT_MODE = "log"


@dataclass(frozen=True)
class Replan:
    """What the search of one window found (:func:`replan_window`): the re-plan, both plans
    priced on the window's measurements, and the state the switch would move; the switch's
    fixed part, the amortisation and the hysteresis are the deciding rank's
    (:meth:`Adapter.decide`)."""

    window: tuple[int, int]
    plan: Plan = field(compare=False)       # the re-plan's plan
    same_layout: bool                       # the re-plan is the plan it runs: no switch to pay
    current: float                          # the current plan's iteration, objective's unit
    new: float                              # the re-plan's
    move_s: float                           # the state crossing nodes, slowest node's NIC time
    moved_bytes: int
    usd_per_second: float | None            # the cost objective's rate of the switch's seconds
    search_s: float                         # the search's wall-clock seconds (reported only)
    stragglers: tuple[Straggler, ...] = ()


@dataclass(frozen=True)
class AdaptDecision:
    """One re-plan considered at a window's end (module doc)."""

    window: tuple[int, int]     # the iterations whose measurements it is made on
    switch: bool
    why: str
    current_s: float            # the current plan's iteration, on the measured profile
    new_s: float                # the re-plan's
    predicted_gain: float       # per iteration, in the objective's unit
    switch_cost_s: float
    moved_bytes: int
    remaining_iterations: int
    amortised_gain: float
    decided_at: int | None = None   # the iteration after which it is taken (None: the window's)
    overhead_s: float = DEFAULT_SWITCH_OVERHEAD_S   # the switch's fixed part priced
    overhead_measured_at: int | None = None     # the switch it was measured at (None: a guess)
    search_s: float = 0.0       # the re-plan's wall-clock seconds (reported, never decided on)
    stragglers: tuple[Straggler, ...] = ()
    plan: Plan | None = field(default=None, compare=False)   # the re-plan's plan

    def line(self) -> str:
        """The Megatron-style console line of the decision."""
        decided = self.window[1] if self.decided_at is None else self.decided_at
        head = (f"adapt: iterations {self.window[0]}-{self.window[1]} (decided after iteration "
                f"{decided}): ")
        slow = ("; stragglers: " + ", ".join(s.describe() for s in self.stragglers)
                if self.stragglers else "")
        fixed = (f"the switch after iteration {self.overhead_measured_at} measured "
                 f"{self.overhead_s:.3g} s" if self.overhead_measured_at is not None
                 else f"{self.overhead_s:.3g} s fixed, no switch measured yet")
        return (head + f"{'SWITCH' if self.switch else 'keep'} ({self.why}): re-plan predicted "
                f"{self.new_s:.4g} s per iteration against {self.current_s:.4g} s now "
                f"({self.predicted_gain:+.1%}), switch cost {self.switch_cost_s:.3g} s "
                f"({self.moved_bytes / 1e9:.3g} GB moved; {fixed}), amortised over "
                f"{self.remaining_iterations} iterations {self.amortised_gain:+.1%}; re-plan "
                f"search {self.search_s:.2f} s" + slow)

    def event(self) -> tuple[str, dict]:
        """The decision as an elastic job's ``adapt`` event: a message and its JSON fields."""
        message = self.line().split(": ", 1)[1]
        return message, {
            "window": list(self.window),
            "decided_at": self.window[1] if self.decided_at is None else self.decided_at,
            "switch": self.switch, "why": self.why,
            "current_iteration_s": round(self.current_s, 6),
            "new_iteration_s": round(self.new_s, 6),
            "predicted_gain": round(self.predicted_gain, 6),
            "switch_cost_s": round(self.switch_cost_s, 3), "moved_bytes": self.moved_bytes,
            "switch_overhead_s": round(self.overhead_s, 3),
            "switch_overhead_measured_at": self.overhead_measured_at,
            "remaining_iterations": self.remaining_iterations,
            "amortised_gain": round(self.amortised_gain, 6),
            "search_s": round(self.search_s, 3),
            "stragglers": [{"rank": s.rank, "node": s.node, "local_rank": s.local_rank,
                            "gpu": s.gpu, "tp": s.tp, "ratio": round(s.ratio, 4)}
                           for s in self.stragglers]}


def plan_fleet(plan: Plan, catalog: dict[str, GPUType], template: Cluster | None = None,
               speeds: dict[tuple[str, int], float] | None = None, *,
               with_idle: bool = False) -> Cluster:
    """The fleet ``plan`` runs on as a cluster: its nodes, each with the GPUs the plan lists on
    it (its idle GPUs are not known to a plan) - with ``with_idle``, every GPU of every
    ``template`` node too (``autohet train --cluster``: the job holds a process waiting on each
    GPU its plan leaves idle, which a re-plan may give work) - links, price and zone from the
    ``template``
    node of the same name (else of the same GPU type; an elastic job's cluster file) or the
    catalog's intra-node link and DEFAULT_NIC_GBS, with ``speeds`` (spec/cluster.py). The
    template's zones (their regions and the links between them) stay where every node found
    its zone there, so a re-plan prices the links between zones and their egress as the plan
    was priced; a node the template does not know leaves the fleet one zone (spec/cluster.py:
    zones are every node's or none's)."""
    counts: dict[str, int] = {}
    gpus: dict[str, str] = {}
    for info in plan.ranks:
        gpus.setdefault(info.node, info.gpu)
        counts[info.node] = max(counts.get(info.node, 0), info.local_rank + 1)
    if with_idle and template is not None:
        for node in template.nodes:
            gpus.setdefault(node.name, node.gpu)
            counts[node.name] = max(counts.get(node.name, 0), node.num_gpus)
    types = {gpu: (template.gpu_types.get(gpu) if template else None) or catalog.get(gpu)
             for gpu in gpus.values()}
    missing = sorted(g for g, t in types.items() if t is None)
    if missing:
        raise ConfigError("<plan>", "ranks", f"GPU types {missing} not in the GPU catalog",
                          "GPU types of the catalog, to re-plan on")
    nodes = []
    for name, gpu in gpus.items():
        like = template.node_like(name, gpu) if template is not None else None
        if like is not None:
            nodes.append(Node(name, gpu, counts[name], like.intra_node_bandwidth_gbs,
                              like.inter_node_bandwidth_gbs, like.spot_price, like.zone))
        else:
            nodes.append(Node(name, gpu, counts[name], types[gpu].intra_node_bandwidth_gbs,
                              DEFAULT_NIC_GBS))
    zoned = template is not None and template.regions and all(n.zone for n in nodes)
    if not zoned:
        nodes = [replace(n, zone=None) for n in nodes]
    fleet = Cluster(plan.cluster, tuple(nodes), types)
    if zoned:
        fleet = replace(fleet, regions=dict(template.regions), links=template.links)
    return fleet.with_speeds(speeds or {})


def switch_cost(previous: Plan, new: Plan, cluster: Cluster,
                overhead_s: float = DEFAULT_SWITCH_OVERHEAD_S) -> tuple[float, int]:
    """(seconds, bytes) of switching from ``previous`` to ``new``: the state crossing nodes
    (planner/state_moves.py), each node's at its NIC, nodes in parallel, plus ``overhead_s``;
    the same plan costs nothing."""
    if _same_layout(previous, new):
        return 0.0, 0
    by_node = recovery_bytes_by_node(previous, new, previous.model)
    seconds = max((b / (cluster.node(n).inter_node_bandwidth_gbs * 1e9)
                   for n, b in by_node.items() if b), default=0.0)
    return overhead_s + seconds, sum(by_node.values())


def _same_layout(a: Plan, b: Plan) -> bool:
    """The same ranks, stages, layers and micro-batches (predictions aside)."""
    def shape(p: Plan):
        return ([(r.node, r.local_rank) for r in p.ranks],
                [(pipe.num_microbatches, [(s.ranks, s.chunks, s.warmup_microbatches)
                                          for s in pipe.stages]) for pipe in p.pipelines])
    return shape(a) == shape(b)


def amortised_gain(now: float, new: float, switch: float, remaining: int) -> float:
    """What switching saves over the ``remaining`` iterations, switch paid, as a fraction of
    what they cost on the current plan (``now``, ``new``: per iteration; ``switch``: once, in
    the same unit). Negative when the switch does not pay back."""
    if remaining <= 0 or now <= 0:
        return 0.0
    return (remaining * (now - new) - switch) / (remaining * now)


@dataclass
class Adapter:
    """The decision's state across windows (module doc): when it last switched and the last
    switch's measured fixed part. Its fields are plain values: plan_switch.py hands them to the
    next generation's deciding rank."""

    threshold: float = DEFAULT_THRESHOLD
    hold_windows: int = DEFAULT_HOLD
    overhead_s: float = DEFAULT_SWITCH_OVERHEAD_S   # the fixed part before any switch measured
    windows_since_switch: int | None = None     # None: never switched
    measured_overhead_s: float | None = None    # the last switch's fixed part, measured
    measured_at: int | None = None              # the iteration that switch came after

    @property
    def fixed_switch_s(self) -> float:
        """The fixed part a switch is priced at (module doc)."""
        return self.overhead_s if self.measured_overhead_s is None else self.measured_overhead_s

    def switch_measured(self, iteration: int, seconds: float, move_s: float) -> None:
        """A switch after ``iteration`` took ``seconds`` from the stop to the new plan's first
        iteration trained, of which ``move_s`` was priced as its state crossing nodes: later
        switches are priced at the rest (module doc)."""
        self.measured_overhead_s = max(0.0, seconds - move_s)
        self.measured_at = iteration

    def judge(self, window: tuple[int, int], current: float, new: float, switch_s: float,
              switch_unit: float, moved: int, remaining: int,
              held: Callable[[], tuple[tuple[int, int], float]] | None = None,
              **extra) -> AdaptDecision:
        """The decision from the figures (pure but for ``held``; :meth:`decide` prices them):
        ``current`` and ``new`` per iteration and ``switch_unit`` in the objective's unit,
        ``switch_s`` the switch in seconds; ``held()``: the next window's iterations and the
        same re-plan's amortised gain on them, asked only where this window's qualifies (None:
        no next window measured, nothing switches). Advances the hysteresis state."""
        if self.windows_since_switch is not None:
            self.windows_since_switch += 1
        gain = (current - new) / current if current > 0 else 0.0
        amortised = amortised_gain(current, new, switch_unit, remaining)
        switch = False
        if remaining <= 0:
            why = "no iterations left"
        elif gain <= 0:
            why = "no faster plan"
        elif amortised < self.threshold:
            why = (f"{'declined' if gain >= self.threshold else 'below threshold'}: "
                   f"{gain:.1%} faster, {amortised:+.1%} after the switch's cost over the "
                   f"{remaining} iterations left, under {self.threshold:.0%}")
        elif self.windows_since_switch is not None and \
                self.windows_since_switch <= self.hold_windows:
            why = (f"hold: {self.windows_since_switch} of the {self.hold_windows} windows "
                   "after the last switch")
        elif held is None:
            why = "gain seen in one window: it must hold for a second"
        else:
            (first, last), again = held()
            if again < self.threshold:
                why = (f"gain did not hold: {amortised:+.1%} amortised, {again:+.1%} on "
                       f"iterations {first}-{last}, under {self.threshold:.0%}")
            else:
                why, switch = (f"{amortised:+.1%} amortised gain held two windows, "
                               f"{again:+.1%} on iterations {first}-{last}"), True
                self.windows_since_switch = 0
        return AdaptDecision(window, switch, why, current, new, gain, switch_s, moved,
                             remaining, amortised, **extra)

    def _switch_price(self, found: Replan) -> tuple[float, float]:
        """(seconds, objective's unit) of switching to ``found``'s re-plan: its state moves plus
        :attr:`fixed_switch_s`, nothing where it is the plan the job runs."""
        seconds = 0.0 if found.same_layout else self.fixed_switch_s + found.move_s
        unit = seconds * found.usd_per_second if found.usd_per_second is not None else seconds
        return seconds, unit

    def decide(self, found: Replan, remaining: int, decided_at: int | None = None,
               confirm: Callable[[Plan], Replan] | None = None) -> AdaptDecision:
        """The decision on a window's re-plan, switching after iteration ``decided_at`` (None:
        the window's last) with ``remaining`` iterations after it: the switch priced
        (:meth:`_switch_price`), then :meth:`judge`; ``confirm(plan)``: the re-plan ``plan``
        priced on the next window's measurements (:func:`confirm_window`), which the gain must
        hold on (None: no next window, nothing switches)."""
        seconds, unit = self._switch_price(found)

        def held() -> tuple[tuple[int, int], float]:
            again = confirm(found.plan)
            return again.window, amortised_gain(again.current, again.new,
                                                self._switch_price(again)[1], remaining)
        return self.judge(found.window, found.current, found.new, seconds, unit,
                          found.moved_bytes, remaining, held=held if confirm else None,
                          decided_at=decided_at, overhead_s=self.fixed_switch_s,
                          overhead_measured_at=self.measured_at, search_s=found.search_s,
                          stragglers=found.stragglers, plan=found.plan)

    def consider(self, plan: Plan, cluster: Cluster, profile: Profile, remaining: int,
                 window: tuple[int, int], stragglers: tuple[Straggler, ...] = (), *,
                 precision: str | None = None,
                 confirm_on: tuple[Cluster, Profile, tuple[int, int]] | None = None
                 ) -> AdaptDecision:
        """:func:`price_replan` and :meth:`decide` in one call, decided at the window's end;
        ``confirm_on``: the next window's fleet, profile and iterations, to confirm the gain on
        (:func:`price_candidate`; None: nothing switches)."""
        confirm = None
        if confirm_on is not None:
            fleet, measured, iterations = confirm_on

            def confirm(candidate: Plan) -> Replan:
                return price_candidate(plan, candidate, fleet, measured, iterations)
        return self.decide(price_replan(plan, cluster, profile, window, stragglers,
                                        precision=precision), remaining, confirm=confirm)


def price_replan(plan: Plan, cluster: Cluster, profile: Profile, window: tuple[int, int],
                 stragglers: tuple[Straggler, ...] = (), *,
                 precision: str | None = None) -> Replan:
    """Re-plan ``cluster`` (the fleet ``plan`` runs on, with the stragglers' speeds) on
    ``profile`` (what the window measured, merged over the plan's own) and price both plans and
    the state the switch moves (module doc). ConfigError where no plan fits."""
    started = time.perf_counter()
    found = replan(plan, cluster, plan.model, profile, precision=precision,
                   cluster_file="<fleet>", search_unchanged=True)
    return _priced(plan, found.plan, found.cost, cluster, profile, window, stragglers, started)


def price_candidate(plan: Plan, candidate: Plan, cluster: Cluster, profile: Profile,
                    window: tuple[int, int], stragglers: tuple[Straggler, ...] = ()) -> Replan:
    """:func:`price_replan`'s figures for ``candidate``, a re-plan already found, priced by the
    cost model on ``profile`` without a search."""
    started = time.perf_counter()
    resolved = resolve_profile(cluster, candidate.model, profile, candidate.micro_batch_size,
                               candidate.seq_length)
    cost = evaluate_plan(candidate, cluster, resolved, with_timeline=False,
                         memory_headroom=plan_memory_headroom(candidate),
                         charge=plan_charge(candidate))
    return _priced(plan, candidate, cost, cluster, profile, window, stragglers, started)


def _priced(plan: Plan, candidate: Plan, cost: PlanCost, cluster: Cluster, profile: Profile,
            window: tuple[int, int], stragglers: tuple[Straggler, ...],
            started: float) -> Replan:
    """The :class:`Replan` of ``candidate`` (priced at ``cost``) against ``plan``, priced here
    on ``profile``; ``started``: the perf_counter the work began at."""
    resolved = resolve_profile(cluster, plan.model, profile, plan.micro_batch_size,
                               plan.seq_length)
    now = evaluate_plan(plan, cluster, resolved, with_timeline=False,
                        memory_headroom=plan_memory_headroom(plan), charge=plan_charge(plan))
    search_s = time.perf_counter() - started
    move_s, moved = switch_cost(plan, candidate, cluster, overhead_s=0.0)
    objective = objective_of(plan)
    if objective.priced and (now.usd_per_hour is None or cost.usd_per_hour is None):
        objective = THROUGHPUT
    return Replan(window, candidate, _same_layout(plan, candidate),
                  _per_iteration(objective, now), _per_iteration(objective, cost),
                  move_s, moved, now.usd_per_hour / 3600 if objective.priced else None,
                  search_s, tuple(stragglers))


def _per_iteration(objective, cost: PlanCost) -> float:
    """An iteration in the objective's unit: seconds, or the cost objective's USD."""
    if objective.priced:
        return cost.usd_per_hour / 3600 * cost.iteration_time_s
    return cost.iteration_time_s


def _window_inputs(plan: Plan, stages, priors, *, catalog: dict[str, GPUType], precision,
                   attention: str, fusions: dict[str, bool] | None, template: Cluster | None,
                   with_idle: bool, idle_measured: Profile | None = None
                   ) -> tuple[Cluster, Profile, tuple[Straggler, ...]]:
    """What a window's re-plan is priced on: the plan's fleet with the measured speeds, the
    measured profile (over what the GPUs the plan leaves idle measured of themselves,
    ``idle_measured``, over the plan's recorded profile) and the stragglers."""
    speeds = measured_speeds(plan, stages, priors)
    stragglers = tuple(find_stragglers(plan, stages, priors))
    measured = profile_from_window(plan, stages, priors, precision=precision,
                                   attention=attention, fusions=fusions, speeds=speeds)
    profile = measured
    # the idle GPUs' types as they measured (their entries beat the plan's recorded ones, the
    # window's beat both), and the plan's other entries (TP degrees it did not run); one of
    # another precision, attention or fusions is left out
    for other, label in ((idle_measured, "<idle GPUs>"), (plan_profile(plan), "<plan>")):
        if other is not None:
            try:
                profile = merge_profiles([profile, other], ["<measured>", label])
            except ConfigError:
                pass
    return (plan_fleet(plan, catalog, template, speeds, with_idle=with_idle), profile,
            stragglers)


def replan_window(plan: Plan, stages, window: tuple[int, int], priors, *,
                  catalog: dict[str, GPUType], precision, attention: str,
                  fusions: dict[str, bool] | None, template: Cluster | None = None,
                  with_idle: bool = False, idle_measured: Profile | None = None) -> Replan:
    """The search of a window (module doc): ``stages`` the window's StageMeasures, ``priors``
    the entries the plan was priced on (from_run.priced_entries), ``precision`` the job's
    (spec/precision.py), ``attention`` and ``fusions`` what its layers ran; ``template`` and
    ``with_idle``: :func:`plan_fleet`'s; ``idle_measured``: the profile the GPUs the plan
    leaves idle measured of themselves (plan_switch.py ``Members.idle_measured``)."""
    fleet, profile, stragglers = _window_inputs(
        plan, stages, priors, catalog=catalog, precision=precision, attention=attention,
        fusions=fusions, template=template, with_idle=with_idle, idle_measured=idle_measured)
    return price_replan(plan, fleet, profile, window, stragglers, precision=precision.name)


def confirm_window(plan: Plan, candidate: Plan, stages, window: tuple[int, int], priors, *,
                   catalog: dict[str, GPUType], precision, attention: str,
                   fusions: dict[str, bool] | None, template: Cluster | None = None,
                   with_idle: bool = False, idle_measured: Profile | None = None) -> Replan:
    """:func:`replan_window`'s figures for ``candidate`` (a re-plan an earlier window's search
    found) on this window's measurements, without a search: whether its gain holds."""
    fleet, profile, stragglers = _window_inputs(
        plan, stages, priors, catalog=catalog, precision=precision, attention=attention,
        fusions=fusions, template=template, with_idle=with_idle, idle_measured=idle_measured)
    return price_candidate(plan, candidate, fleet, profile, window, stragglers)
