"""A profile from a training run: per-layer costs derived from a measurement window.

A job that measures itself (runtime/stage_drift.py) knows every stage's forward + backward time
per micro-batch on the GPUs it runs on. ``--autohet-measured-profile PATH`` turns that into a
profile file (profiling/profile.py, ``source: measured``) that ``autohet plan --profile`` takes
and merges with others, so twenty iterations on a fleet give a profile of every GPU type in it,
with no separate profiling step.

A stage's time is not a layer's: ``t = n L + [first] E + [last] O`` per micro-batch (the cost
model's formula, ``ProfileEntry.stage_compute_s``, with the recomputed forward under activation
recompute), and one window gives one ``t`` per stage. The derivation therefore assumes that the
prediction was wrong by one factor per (GPU type, TP degree): it takes the entry the stage was
priced on (:func:`priced_entries`: the plan's recorded profile, its gaps estimated from the GPU
catalog and calibrated as the planner does) and scales every time in it - layer, embedding and
output, forward and backward - by ``k = measured / priced`` stage time, so the fwd / bwd split
and the embedding and output layer's share relative to a layer stay the prior's, and the new
entry prices the stage at exactly its measured time. The stages of one (GPU type, TP degree) -
several pipelines of one shape, or stages of another depth - share one entry: ``k`` is the sum
of their measured times over the sum of their priced times, which prices each exactly when they
drifted alike, and otherwise prices their sum (the window's record keeps each stage's own time).
``k`` is measured over priced rather than over the plan's stored ``predicted_time_s``: the two
agree for a plan priced on these entries (to the file's rounding), and a hand-written plan has
no prediction at all. Memory figures (activation bytes) and parameter counts are the prior's:
they are computed, not timed. The split is the prior's even where the run would show another
(a slow embedding): one window has too few equations to tell.

``priced_entries(plan, catalog)``: the prior of every (GPU type, TP degree) of the plan.
``profile_from_window(plan, stages, priors, precision=, attention=, fusions=)``: the run's
profile from a window's stages (runtime/stage_drift.py ``StageMeasure``: pipeline, stage,
per_microbatch_s).
``find_stragglers(plan, stages, priors, threshold=)``: the GPUs slower than the others of their
type and TP degree (per TP group, its slowest rank's ``StageMeasure.rank_compute_s``,
normalised as above: per micro-batch, over the stage's priced time); ``measured_speeds``:
every measured GPU's speed, for spec/cluster.py ``Cluster.with_speeds`` (and for
``profile_from_window``'s ``speeds``, which keeps a straggler's slowness out of its type's
entry).
``save_run_profile(path, profile)``: written atomically, over the entries a previous window or
run of the same model, precision, attention and fusions left in the file (an elastic job's
generations on changing fleets add up to one profile).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Plan
from megatron_autohet.profiling.estimate import estimate_entry
from megatron_autohet.profiling.profile import DEFAULT_ATTENTION, Profile, ProfileEntry
from megatron_autohet.spec.gpus import GPUType
from megatron_autohet.spec.precision import Precision

FLAG = "--autohet-measured-profile"
# A GPU this much slower than the others of its type and TP degree over a window is a straggler
# (find_stragglers): beyond a window's noise on a loaded host (medians of 20 iterations), below
# the 0.6-0.8x of a throttled or shared GPU.
STRAGGLER_THRESHOLD = 0.15


def _stage_keys(plan: Plan):
    """((pipeline, stage), (GPU type, TP degree), stage, first, last) of every stage."""
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            yield ((p, s), (plan.ranks[stage.ranks[0]].gpu, len(stage.ranks)), stage, s == 0,
                   s == len(pipe.stages) - 1)


def priced_entries(plan: Plan, catalog: dict[str, GPUType], source: str = "<plan>"
                   ) -> dict[tuple[str, int], ProfileEntry]:
    """The entry each (GPU type, TP degree) of the plan was priced on: its recorded profile's
    (``plan.profile``), calibrated over the analytic estimates of the GPU catalog where it has
    no entry (planner/space.py ``resolve_profile``, with the catalog's intra-node bandwidth for
    the TP all-reduces, where the planner took the cluster's). ConfigError naming the flag when a
    GPU type is in neither: there is no split to scale."""
    recorded = Profile.from_dict(plan.profile, f"{source}: profile") if plan.profile else None
    attention = recorded.attention if recorded is not None else DEFAULT_ATTENTION
    mbs, seq = plan.micro_batch_size, plan.seq_length
    wanted = {key for _, key, _, _, _ in _stage_keys(plan)}
    if recorded is not None:
        wanted |= {(gpu, tp) for gpu, tp, m, s in recorded.entries if (m, s) == (mbs, seq)}
    base = Profile(plan.model.name, attention=attention)
    for gpu, tp in sorted(wanted):
        if gpu in catalog:
            base.add(estimate_entry(plan.model, catalog[gpu], tp, mbs, seq,
                                    catalog[gpu].intra_node_bandwidth_gbs, attention))
    resolved = recorded.calibrated_over(base) if recorded is not None else base
    priors = {}
    for _, (gpu, tp), _, _, _ in _stage_keys(plan):
        if not resolved.has(gpu, tp, mbs, seq):
            raise ConfigError(source, FLAG, f"the plan's {gpu} TP{tp} stages have no entry to "
                              f"scale: {gpu} is neither in the plan's profile nor in the GPU "
                              "catalog", "a plan of GPU types of the catalog, or priced on a "
                              "profile with their entries")
        priors[gpu, tp] = resolved.get(gpu, tp, mbs, seq)
    return priors


def _scaled(entry: ProfileEntry, k: float) -> ProfileEntry:
    return entry.scaled(k, source="measured")


def _priced_s(plan: Plan, key, stage, first: bool, last: bool, priors) -> float:
    """The stage's forward + backward per micro-batch on the entry it was priced on."""
    return sum(priors[key].stage_compute_s(stage.num_layers, first, last,
                                           plan.activation_recompute))


def _stage_speed(plan: Plan, stage, speeds: dict[tuple[str, int], float] | None) -> float:
    if not speeds:
        return 1.0
    return min(speeds.get((plan.ranks[r].node, plan.ranks[r].local_rank), 1.0)
               for r in stage.ranks)


def profile_from_window(plan: Plan, stages, priors: dict[tuple[str, int], ProfileEntry], *,
                        precision: Precision, attention: str,
                        fusions: dict[str, bool] | None,
                        speeds: dict[tuple[str, int], float] | None = None) -> Profile:
    """The run's profile (module doc): an entry per (GPU type, TP degree) of the plan whose
    stages the window timed, ``source: measured``, in the job's precision, with the attention
    and fusions its layers ran. ``stages``: the window's per-stage measures (``pipeline``,
    ``stage``, ``per_microbatch_s``); a (GPU type, TP degree) with no time (no iteration read
    in the window) gets no entry. ``speeds``: the stragglers' speeds ((node, local rank) ->
    speed, :func:`measured_speeds`): a stage on a straggler counts as priced at its speed, so
    the entry is its type's, and the straggler's slowness stays its own (spec/cluster.py
    ``speeds``), not its type's."""
    measured = {(s.pipeline, s.stage): s.per_microbatch_s for s in stages}
    sums: dict[tuple[str, int], list[float]] = {}
    for where, key, stage, first, last in _stage_keys(plan):
        if measured.get(where, 0.0) <= 0:
            continue
        priced = _priced_s(plan, key, stage, first, last, priors) / _stage_speed(
            plan, stage, speeds)
        total = sums.setdefault(key, [0.0, 0.0])
        total[0] += measured[where]
        total[1] += priced
    profile = Profile(plan.model.name, precision=precision, attention=attention,
                      fusions=None if fusions is None else dict(fusions))
    for key, (seconds, priced) in sums.items():
        if priced > 0:
            profile.add(_scaled(priors[key], seconds / priced))
    return profile


def save_run_profile(path: str | Path, profile: Profile) -> None:
    """Write ``profile`` atomically (Profile.save), keeping the entries of other keys that the
    file holds from an earlier window or run of the same model, precision, attention and
    fusions; a file that does not load, or describes other figures, is replaced."""
    path = Path(path)
    kept = {}
    if path.is_file():
        try:
            old = Profile.load(path)
        except ConfigError:
            old = None
        if old is not None and (old.model, old.precision.name, old.attention, old.fusions) == (
                profile.model, profile.precision.name, profile.attention, profile.fusions):
            kept = old.entries
    out = Profile(profile.model, {**kept, **profile.entries}, profile.precision,
                  profile.attention, profile.fusions)
    out.save(path)


@dataclass(frozen=True)
class Straggler:
    """A GPU measured slower than the others of its type (:func:`find_stragglers`)."""

    rank: int
    node: str
    local_rank: int
    gpu: str
    tp: int
    ratio: float        # its time over its type's typical time, both normalised (> 1)

    @property
    def speed(self) -> float:
        """What the cost model prices it at (spec/cluster.py ``speeds``): typical / measured."""
        return 1.0 / self.ratio

    def describe(self) -> str:
        return (f"rank {self.rank} ({self.node} GPU {self.local_rank}, {self.gpu} TP{self.tp}) "
                f"{self.ratio:.2f}x its type's time")


def _normalised(plan: Plan, stages, priors) -> dict[tuple[str, int], dict[tuple[int, ...],
                                                                         float]]:
    """Per (GPU type, TP degree), each measured TP group's (its ranks) compute per micro-batch
    over its stage's priced time (as :func:`profile_from_window` scales: layer count,
    embedding and output layer taken out by the entry the stage was priced on); a group's
    compute is its slowest rank's (``rank_compute_s``; the stage's where a window lacks it)."""
    measured = {(s.pipeline, s.stage): s for s in stages}
    out: dict[tuple[str, int], dict[tuple[int, ...], float]] = {}
    for where, key, stage, first, last in _stage_keys(plan):
        m = measured.get(where)
        priced = _priced_s(plan, key, stage, first, last, priors)
        if m is None or priced <= 0:
            continue
        seconds = max(m.rank_compute_s or (m.compute_s,))
        if seconds > 0:
            out.setdefault(key, {})[tuple(stage.ranks)] = seconds / m.num_microbatches / priced
    return out


def find_stragglers(plan: Plan, stages, priors: dict[tuple[str, int], ProfileEntry],
                    threshold: float = STRAGGLER_THRESHOLD) -> list[Straggler]:
    """The GPUs of a window slower than the others of their (GPU type, TP degree) by more
    than ``threshold`` (pure; the module doc's normalisation, per micro-batch and per priced
    stage time). TP groups are compared, as the cost model prices them (a group computes in
    lock step, at its slowest member's speed; inside a group a rank's own compute also holds
    its waits for the others, so the members' times do not say which one is slow): every
    member of a slow group is reported at the group's ratio. The typical time of a key is the
    lower median of its groups' (with two groups, the faster one's), so one slow group of two
    is found at its full slowness, and a key whose groups are all alike (a lone group, or a type
    slow as a whole: the profile's drift, not a straggler) has none."""
    found = []
    for (gpu, tp), times in sorted(_normalised(plan, stages, priors).items()):
        typical = statistics.median_low(sorted(times.values()))
        for ranks, value in sorted(times.items()):
            ratio = value / typical
            if ratio > 1 + threshold:
                for r in ranks:
                    info = plan.ranks[r]
                    found.append(Straggler(r, info.node, info.local_rank, gpu, tp, ratio))
    return found


def measured_speeds(plan: Plan, stages, priors: dict[tuple[str, int], ProfileEntry],
                    threshold: float = STRAGGLER_THRESHOLD) -> dict[tuple[str, int], float]:
    """(node, local rank) -> speed of every GPU the window measured: a straggler's
    (:func:`find_stragglers`), 1.0 for the others (a recovered straggler is priced back at its
    type's speed). GPUs without a time in the window are not in it."""
    speeds = {(plan.ranks[r].node, plan.ranks[r].local_rank): 1.0
              for times in _normalised(plan, stages, priors).values()
              for ranks in times for r in ranks}
    for s in find_stragglers(plan, stages, priors, threshold):
        speeds[s.node, s.local_rank] = s.speed
    return speeds
