"""``--autohet-adapt replan``: a job that switches plans in its processes (``autohet train``).

:func:`train_adapting` is ``autohet train``'s job: job.py's ``train_job``, and with
``--autohet-adapt replan`` one generation per plan in the same processes, switching at a
window's end to the plan its decision chose (planner/adapt.py): every rank saves the iteration,
the new plan's ranks make its process group (:func:`host_generation_store`, which an elastic
job's in-process re-plan shares) and recover that step, and train on; the new plan's rank 0
times the switch, whose seconds price the next one. With ``--cluster`` every GPU of the cluster
file has a process (:class:`Members`, :func:`job_members`): those a plan leaves idle measure
their GPU once, when that plan has trained an iteration (:func:`measure_idle_gpu`: the window
measures only the GPUs that train; the first re-plan waits for it, so it is priced on the same
inputs at any load) and wait on the members' store for that plan's end, so a re-plan of the
whole cluster, priced on what they measured, may give them work.

torch is imported inside the functions that use it: ``autohet train`` imports this module at
start-up, long before (and in the launcher, without) any training.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta

from megatron_autohet.checkpoint.lease import rank_owner_name
from megatron_autohet.errors import ConfigError
from megatron_autohet.job import TrainOptions, job_dashboard, train_job
from megatron_autohet.plan import Plan, RankInfo, plan_from_dict
from megatron_autohet.profiling.measure import measure_in_process
from megatron_autohet.profiling.profile import Profile, merge_profiles
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.model import ModelSpec

# A switch's new process group meets on a store one of its ranks hosts (as an elastic job's
# in-process re-plan, elastic/worker.py): the store of the old group belongs to its launcher.
GENERATION_STORE_TIMEOUT = timedelta(minutes=5)


def host_generation_store(timeout: timedelta = GENERATION_STORE_TIMEOUT):
    """A TCP store for the next generation's process group, hosted by this rank: (store,
    address, port). The address is ``AUTOHET_LOCAL_ADDR`` where set (emulated nodes), else the
    host name; port 0: the store binds a port the system picks (no window for another process
    to take it between choosing and binding)."""
    import torch.distributed as dist     # torch: a rank's code (see the module's docstring)

    addr = os.environ.get("AUTOHET_LOCAL_ADDR") or socket.gethostname()
    store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    return store, addr, store.port


def join_generation_store(addr: str, port: int, timeout: timedelta = GENERATION_STORE_TIMEOUT):
    """The store :func:`host_generation_store` hosts, from another rank."""
    import torch.distributed as dist     # torch: a rank's code (see the module's docstring)

    return dist.TCPStore(addr, port, is_master=False, timeout=timeout)


def _rank_in(plan: Plan, gpu: RankInfo | tuple[str, int]) -> int | None:
    """The rank of ``plan`` on the GPU (node, local rank) of ``gpu``; None: idle in it."""
    where = gpu if isinstance(gpu, tuple) else (gpu.node, gpu.local_rank)
    return next((r.rank for r in plan.ranks if (r.node, r.local_rank) == where), None)


def _store_host(old: Plan, new: Plan) -> int:
    """The rank of ``old`` that hosts the new generation's store: the first that trains in
    ``new`` (without :class:`Members` an idle one ends its process); where none does (the new
    plan runs on members idle until now, each of which lives to the job's end), rank 0."""
    return next((r.rank for r in old.ranks if _rank_in(new, r) is not None), 0)


def job_members(plan: Plan, cluster: Cluster, plan_label: str,
                cluster_label: str) -> tuple[tuple[str, int], ...]:
    """Every GPU of ``cluster`` as (node, local rank), member by member: the plan's ranks in
    rank order (member r is plan rank r in the first generation), then the GPUs the plan
    leaves idle, in the cluster file's order. ConfigError where a plan rank's GPU is not one
    of the cluster's."""
    gpus = {(d.node, d.local_rank): d.gpu for d in cluster.devices()}
    for r in plan.ranks:
        if gpus.get((r.node, r.local_rank)) != r.gpu:
            raise ConfigError(plan_label, f"ranks[{r.rank}]", f"{r.gpu} GPU {r.local_rank} of "
                              f"node {r.node} is not a GPU of {cluster_label}",
                              "a plan made for the --cluster file (autohet plan --cluster)")
    planned = [(r.node, r.local_rank) for r in plan.ranks]
    return tuple(planned + [gpu for gpu in gpus if gpu not in set(planned)])


@dataclass(frozen=True)
class Members:
    """``autohet train --autohet-adapt replan --cluster``: a process on every GPU of the
    cluster, whether the plan trains on it or not (:func:`job_members`' order), so that a
    re-plan (planned on all of them: planner/adapt.py ``plan_fleet(with_idle=True)``) may give
    work to a GPU the plan leaves idle and a later one take it off. A member idle in a plan
    waits on ``store`` for that plan's end (:func:`train_adapting`); no process ends before the
    job does."""
    store: object                           # every member's store (torchrun's rendezvous)
    index: int                              # this process's member
    gpus: tuple[tuple[str, int], ...]       # every member's GPU, (node, local rank)
    backend: str                            # the process groups' ("gloo" on the CPU, "nccl")
    gpu_types: tuple[str, ...] = ()         # every member's GPU type (the cluster file's)

    @property
    def gpu(self) -> tuple[str, int]:
        return self.gpus[self.index]

    def join_first(self, plan: Plan, timeout: timedelta) -> int | None:
        """The first plan's process group, made by its ranks on the members' store: this
        member's plan rank, None where the plan leaves its GPU idle (no group)."""
        import torch.distributed as dist     # torch: a rank's code (module docstring)

        rank = _rank_in(plan, self.gpu)
        if rank is not None:
            dist.init_process_group(self.backend, rank=rank, world_size=plan.world_size,
                                    timeout=timeout,
                                    store=dist.PrefixStore(f"{_MEMBERS}train/", self.store))
        return rank

    def announce(self, generation: int, message: dict) -> None:
        """The end of ``generation``, by its plan's rank 0, for the members idle in it: the
        next plan and where its group meets, or ``{"finished": last iteration}``."""
        self.store.set(f"{_MEMBERS}end/{generation}", pickle.dumps(message))

    def wait_end(self, generation: int) -> dict:
        """What :meth:`announce` said of ``generation``, waited for as long as it trains (a
        lost store, a job that failed, ends the wait: torchrun stops every process)."""
        import torch.distributed as dist     # torch: a rank's code (module docstring)

        key = f"{_MEMBERS}end/{generation}"
        while True:
            try:
                self.store.wait([key], timedelta(minutes=1))
                return pickle.loads(self.store.get(key))
            except dist.DistStoreError as err:      # a timeout: it still trains
                if "timeout" not in str(err).lower():
                    raise

    def announce_training(self, generation: int) -> None:
        """By ``generation``'s rank 0 once its first iteration is trained: the GPUs idle in
        it measure themselves from then on (:meth:`wait_training`)."""
        self.store.set(f"{_MEMBERS}training/{generation}", b"1")

    def wait_training(self, generation: int) -> bool:
        """Until ``generation`` has trained an iteration (True) or ended first (False). An idle
        GPU measures itself then, under the load the GPUs that train are measured under (the
        windows'), not beside the start-up of their processes: at a job's start, on the
        emulated cluster, that measured an idle GPU's layer 20-45% slower than it trains."""
        keys = [f"{_MEMBERS}training/{generation}", f"{_MEMBERS}end/{generation}"]
        while True:
            if self.store.check(keys[:1]):
                return True
            if self.store.check(keys[1:]):
                return False
            time.sleep(0.1)

    def post_measured(self, profile: Profile | None) -> None:
        """This member's measurement of its GPU (:func:`measure_idle_gpu`), for the re-plans;
        None: it could not measure (the re-plans price its type as before)."""
        self.store.set(f"{_MEMBERS}measured/{self.index}",
                       json.dumps(None if profile is None else profile.to_dict()))

    def idle_measured(self, plan: Plan, timeout: timedelta) -> Profile | None:
        """What the members idle in ``plan`` measured of their GPUs (:meth:`post_measured`),
        one profile; None where none could. Waits until every one of them has posted (each
        measures once, when a plan first leaves it idle), so what a window's re-plan is priced
        on is the same at any load: it depends on the plan, not on how far an idle GPU got.
        ``timeout`` is a safety net: past it, one WARNING line and what has been posted. A
        member that trained in an earlier plan and is idle now counts too; what it posted
        stays on the store. Without the members' GPU types (no measurement) None at once."""
        import torch.distributed as dist     # torch: a rank's code (module docstring)

        if not self.gpu_types:
            return None
        idle = [(i, gpu) for i, gpu in enumerate(self.gpus) if _rank_in(plan, gpu) is None]
        keys = {i: f"{_MEMBERS}measured/{i}" for i, _ in idle}
        waiting = [f"{node}:{gpu}" for i, (node, gpu) in idle
                   if not self.store.check([keys[i]])]
        if waiting:
            print(f" adapt: waiting for the GPUs idle in this plan to measure themselves: "
                  f"{', '.join(waiting)}", flush=True)
            try:
                self.store.wait(list(keys.values()), timeout)
            except dist.DistStoreError as err:
                if "timeout" not in str(err).lower():
                    raise
                print(f"WARNING: adapt: GPUs idle in this plan had not measured themselves "
                      f"after {timeout.total_seconds():.0f} s; the re-plan prices their types "
                      f"on the plan's profile", flush=True)
        posted = [json.loads(self.store.get(k)) for k in keys.values() if self.store.check([k])]
        found = [Profile.from_dict(data, "<idle GPU>") for data in posted if data is not None]
        if not found:
            return None
        try:
            return merge_profiles(found, ["<idle GPU>"] * len(found))
        except ConfigError:
            return found[0]

    def finish(self, timeout: timedelta) -> None:
        """At the job's end, on every member: counted done; member 0, whose process may host
        the store, waits (bounded) until every member is, so none reads a store that has gone."""
        self.store.add(f"{_MEMBERS}done", 1)
        if self.index == 0:
            deadline = time.monotonic() + timeout.total_seconds()
            while (self.store.add(f"{_MEMBERS}done", 0) < len(self.gpus)
                   and time.monotonic() < deadline):
                time.sleep(0.05)


_MEMBERS = "autohet/members/"


def describe_plan(plan: Plan) -> str:
    """A plan in one phrase: its pipelines, each stage's GPUs and layers, micro-batches."""
    pipes = ", ".join("[" + " | ".join(
        f"{plan.ranks[s.ranks[0]].gpu}{f' x{s.tp}' if s.tp > 1 else ''} layers "
        f"{s.layers_label()}" for s in pipe.stages) + f"] x{pipe.num_microbatches}"
        for pipe in plan.pipelines)
    return (f"{len(plan.pipelines)} pipeline{'s' if len(plan.pipelines) > 1 else ''} on "
            f"{plan.world_size} GPUs {pipes}")


def resume_options(options: TrainOptions, iteration: int) -> TrainOptions:
    """The options of the generation after a switch at ``iteration``: the job's own, resuming
    exactly that step from where the job saves it (checkpoint/recovery.py loads any plan's step
    into any other plan), all of its state (a --finetune or --no-load-* was the first
    generation's)."""
    ckpt = options.checkpoint
    return replace(options, checkpoint=replace(
        ckpt, load=ckpt.local_dir or ckpt.save, ckpt_step=iteration, finetune=False,
        no_load_optim=False, no_load_rng=False, exit_on_missing_checkpoint=True))


@dataclass(frozen=True)
class SwitchTiming:
    """Where a switch's seconds went, on the clock of the process that is the new plan's rank 0
    (it stopped, saved and left the old group with the others)."""
    save_s: float               # the stop agreed -> the iteration saved, the trainer freed
    group_s: float              # the new plan's process group made
    build_s: float              # its model, optimizer and checkpointer built
    recovery_s: float           # the step recovered (checkpoint/recovery.py's phases)
    first_iteration_s: float    # the new plan's first iteration trained

    @property
    def total_s(self) -> float:
        """From the stop to the new plan's first iteration trained: what the switch cost."""
        return (self.save_s + self.group_s + self.build_s + self.recovery_s
                + self.first_iteration_s)


# The recovery's sequential phases (checkpoint/recovery.py RecoveryReport: its load runs during
# its fetch, and each tier's seconds lie inside the fetch's)
_RECOVERY_PHASES = ("agree", "stage", "fetch", "apply")


@dataclass(frozen=True)
class _Switched:
    """A switch done, reported by the new plan's rank 0 after its first iteration."""
    before: Plan
    after: Plan
    iteration: int
    move_s: float               # the state crossing nodes, as the decision priced it
    stopped_at: float           # time.monotonic(): the ranks agreed on the switch
    saved_at: float             # the iteration saved on every rank, the trainer freed
    grouped_at: float           # the new plan's process group made

    def timing(self, built_at: float, recovery, trained_at: float) -> SwitchTiming:
        """The switch's parts, ``built_at`` the new plan's trainer and checkpointer built,
        ``recovery`` its RecoveryReport (None: nothing loaded), ``trained_at`` its first
        iteration done."""
        recovery_s = (sum(recovery.seconds.get(p, 0.0) for p in _RECOVERY_PHASES)
                      if recovery is not None else 0.0)
        return SwitchTiming(self.saved_at - self.stopped_at, self.grouped_at - self.saved_at,
                            built_at - self.grouped_at, recovery_s,
                            max(0.0, trained_at - built_at - recovery_s))

    def line(self, timing: SwitchTiming, recovery, priced_s: float) -> str:
        """The switch's console line: the plans, the state moved, each part's seconds and the
        fixed part later switches are priced at (``priced_s``)."""
        idle = [f"{r.node}:{r.local_rank}" for r in self.before.ranks
                if _rank_in(self.after, r) is None]
        moved = ("" if recovery is None else
                 f", recovered {sum(recovery.job_bytes.values()) / 2**20:.1f} MiB (local disks "
                 f"{recovery.job_bytes.get('own', 0) / 2**20:.1f}, peers "
                 f"{recovery.job_bytes.get('peer', 0) / 2**20:.1f}, S3 "
                 f"{recovery.job_bytes.get('s3', 0) / 2**20:.1f})")
        nxt = self.iteration + 1
        return (f"adapt: switched plans after iteration {self.iteration}: "
                f"{describe_plan(self.before)} -> {describe_plan(self.after)}"
                + (f" (idle: {', '.join(idle)})" if idle else "")
                + f"; state saved in {timing.save_s:.2f} s{moved}; new process group "
                f"{timing.group_s:.2f} s, model and optimizer {timing.build_s:.2f} s, recovery "
                f"{timing.recovery_s:.2f} s, iteration {nxt} {timing.first_iteration_s:.2f} s; "
                f"{timing.total_s:.2f} s from the stop to iteration {nxt} trained; later "
                f"switches priced at {priced_s:.2f} s plus the state they move across nodes")


class _PlanSwitch:
    """One generation's side of ``--autohet-adapt replan`` (:func:`train_adapting`): the window
    sink's SWITCH decision (``decided``, on rank 0) and the stop check that makes every rank
    learn it at the window's end (one broadcast on a gloo group of its own, as elastic/stop.py
    explains: the checkpoint writer's collectives run beside it), wrapping the front end's
    stop check; ``next``: the plan switched to, None while none."""

    def __init__(self, plan: Plan, rank: int, options: TrainOptions, make_stop_check, adapter,
                 previous: _Switched | None, on_first_iteration=None):
        self.plan, self.rank, self.options = plan, rank, options
        self.on_first_iteration = on_first_iteration    # rank 0's, after the first iteration
        self.inner = make_stop_check
        self.adapter = adapter                  # rank 0: the decisions' hysteresis
        self.previous = previous
        self.decision = None
        self.next: Plan | None = None
        self.adapter_state: dict | None = None  # the hysteresis the next generation continues
        self.store = None                       # the new group's store, on the rank hosting it
        self.address: tuple[str, int] | None = None
        self.move_s = 0.0                       # the switch's state moves, as it was priced
        self.group = None                       # the stop check's gloo group, every rank's
        self.stopped_at: float | None = None

    def decided(self, decision) -> None:
        """``on_adapt`` of the window sink (rank 0)."""
        if decision.switch:
            self.decision = decision

    def make_stop_check(self, checkpointer):
        import torch.distributed as dist     # torch: a rank's code (see the module's docstring)

        built_at = time.monotonic()     # the new plan's trainer and checkpointer exist
        group = self.group = dist.new_group(backend="gloo", timeout=self.options.timeout)
        inner = self.inner(checkpointer) if self.inner else None
        first = [True]

        def check(iteration: int) -> str | None:
            if first[0]:
                first[0] = False
                if self.previous is not None and self.rank == 0:
                    self._measured(built_at, checkpointer.last_report)
                if self.on_first_iteration is not None and self.rank == 0:
                    self.on_first_iteration()
            switching = (iteration % self.options.measure_window == 0
                         and self._agree(iteration, group))
            action = inner(iteration) if inner else None
            if action == "stop":            # a signal: the job stops, no switch
                self.next = None
                return action
            return "stop" if switching else action
        return check

    def _measured(self, built_at: float, recovery) -> None:
        """After the new plan's first iteration, on its rank 0: the switch's seconds, logged,
        and the price of the next switch's fixed part (planner/adapt.py
        ``Adapter.switch_measured``)."""
        timing = self.previous.timing(built_at, recovery, time.monotonic())
        self.adapter.switch_measured(self.previous.iteration, timing.total_s,
                                     self.previous.move_s)
        print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] "
              f"{self.previous.line(timing, recovery, self.adapter.fixed_switch_s)}", flush=True)

    def _agree(self, iteration: int, group) -> bool:
        """At a window's end, on every rank: rank 0's decision, and where the new group meets."""
        import torch.distributed as dist     # torch: a rank's code (see the module's docstring)

        message = [None]
        if self.rank == 0 and self.decision is not None:
            message = [{"plan": self.decision.plan.to_dict(),
                        "adapter": asdict(self.adapter),
                        "move_s": self.decision.switch_cost_s - self.decision.overhead_s}]
        self.decision = None
        dist.broadcast_object_list(message, src=0, group=group)
        if message[0] is None:
            return False
        new = plan_from_dict(message[0]["plan"], f"<re-plan at iteration {iteration}>")
        host = _store_host(self.plan, new)
        where = [None]
        if self.rank == host:
            self.store, *address = host_generation_store()
            where = [tuple(address)]
        dist.broadcast_object_list(where, src=host, group=group)
        self.next, self.adapter_state, self.address = new, message[0]["adapter"], where[0]
        self.move_s = message[0]["move_s"]
        self.stopped_at = time.monotonic()
        return True


def measure_idle_gpu(members: Members, model: ModelSpec, plan: Plan,
                     options: TrainOptions) -> None:
    """On a member idle in ``plan``, once: its GPU's layer, embedding and output layer at TP 1
    and the plan's micro-batch and sequence (profiling/measure.py ``measure_in_process``:
    megatron-core's modules as trained, with the job's fusions, in this process, which has
    torch and megatron-core imported and its device set already), posted for the re-plans
    (:meth:`Members.post_measured`), whose first waits for it. Without it a re-plan prices an
    idle GPU's type on the plan's recorded profile, however wrong (a window measures only the
    GPUs that train), and never gives that GPU work it would do well. A measurement that fails
    is one WARNING line, posted as such: the job trains on, and prices that type as before."""
    node, gpu = members.gpu
    gpu_type = members.gpu_types[members.index]
    try:
        profile = measure_in_process(model, plan.micro_batch_size, plan.seq_length, gpu_type,
                                     jit_fusions=options.jit_fusions)
    except Exception as err:  # noqa: BLE001 - any failure: the job trains on without it
        print(f"WARNING: adapt: GPU {node}:{gpu} ({gpu_type}), idle in this plan, could not "
              f"measure itself: {err}", flush=True)
        members.post_measured(None)
        return
    members.post_measured(profile)
    (entry,) = profile.entries.values()
    print(f" adapt: GPU {node}:{gpu} ({gpu_type}), idle in this plan, measured itself: a layer "
          f"{1e3 * (entry.layer.forward_s + entry.layer.backward_s):.2f} ms forward + backward "
          f"per micro-batch", flush=True)


def train_adapting(plan: Plan, plan_label: str, model: ModelSpec, options: TrainOptions, *,
                   rank: int | None, local_rank: int, make_stop_check=None,
                   members: Members | None = None) -> int:
    """``autohet train``'s job on an initialised default group whose ranks are the plan's:
    :func:`train_job`, and with ``--autohet-adapt replan`` one generation per plan in the same
    processes. When a window's decision (rank 0's, planner/adapt.py; taken at the next
    window's end, job.py ``adapt_sink``) says SWITCH, every rank learns it and the new plan at
    that window's end, stops after that iteration and saves it
    (the job's checkpointer, as at the end of a run), frees its trainer (runtime/device.py
    ``free_memory``), leaves the old process group and joins the new plan's (its ranks by
    GPU: node and local rank; a store hosted by the first rank that stays), and trains on from
    the saved step (:func:`resume_options`: checkpoint/recovery.py loads any plan's step into
    any other); the decisions' hysteresis goes on from where the switch left it, and the new
    plan's rank 0 times the switch (:class:`SwitchTiming`, logged) and prices later switches'
    fixed part at what it took (planner/adapt.py ``Adapter.switch_measured``).

    Without ``members`` a GPU the new plan leaves idle ends its process (status 0) once the
    step is saved, and later re-plans plan the new plan's GPUs. With ``members`` (every GPU of
    the job's cluster file has a process; ``rank`` None: this one is idle in ``plan``, no
    group) an idle member waits for its plan's end (:meth:`Members.wait_end`, which the plan's
    rank 0 announces) and joins the next plan where that one gives it work; a member a switch
    leaves idle waits likewise, and every member ends with the job. Returns the last
    iteration trained (on a GPU idle at the end: the job's last, or without members the
    switch's)."""
    if options.adapt != "replan" or not options.measure_window:
        return train_job(plan, plan_label, model, options, rank=rank, local_rank=local_rank,
                         make_stop_check=make_stop_check)
    # torch: a rank's code (see the module's docstring)
    import torch.distributed as dist

    from megatron_autohet.runtime.device import free_memory

    if options.checkpoint.owner is None:
        # One writer-lease owner for the whole run (checkpoint/lease.py): each generation's
        # Checkpointer would otherwise draw its own on its rank 0, and where that is another
        # process than the old rank 0 (ranks started one by one, without autohet train's
        # launcher or torchrun to name the run), the lease the old generation kept refuses it.
        if members is not None:
            if members.index == 0:
                members.store.set(f"{_MEMBERS}owner", rank_owner_name())
            owner = [members.store.get(f"{_MEMBERS}owner").decode()]
        else:
            owner = [rank_owner_name() if rank == 0 else None]
            dist.broadcast_object_list(owner, src=0)
        options = replace(options, checkpoint=replace(options.checkpoint, owner=owner[0]))
    state, previous, generation, last = {}, None, 0, 0
    measured = members is None or not members.gpu_types     # an idle member measures once
    # one dashboard across the plans (runtime/dashboard.py): opened once, by the rank that logs
    dashboard = job_dashboard(options) if rank == 0 else None
    try:
        while True:
            if rank is None:            # a member idle in this plan (members only)
                if not measured and members.wait_training(generation):
                    measure_idle_gpu(members, model, plan, options)
                    measured = True
                end = members.wait_end(generation)
                if "finished" in end:
                    last = end["finished"]
                    break
                before, after = plan, plan_from_dict(end["plan"], "<re-plan>")
                plan, last = after, end["iteration"]
                options = resume_options(options, last)
                generation += 1
                rank = _rank_in(after, members.gpu)
                if rank is None:
                    continue
                store = join_generation_store(*end["address"])
                dist.init_process_group(members.backend, rank=rank,
                                        world_size=after.world_size, timeout=options.timeout,
                                        store=dist.PrefixStore(
                                            f"autohet/adapt/{generation - 1}/", store))
                # the announcing process's clock, on this one's: the same machine's monotonic
                ago = time.time() - end["written_unix"]
                previous = _Switched(before, after, last, end["move_s"],
                                     time.monotonic() - ago - end["stopped_ago_s"],
                                     time.monotonic() - ago - end["saved_ago_s"],
                                     time.monotonic())
                plan_label, state = f"<re-plan at iteration {last}>", end["adapter"]
                if rank == 0:
                    dashboard = job_dashboard(options, continues=end["dashboard"])
            adapter = None
            if rank == 0:
                # the planner (pyscipopt): only on the rank that decides
                from megatron_autohet.planner.adapt import Adapter
                adapter = Adapter(**state)
                if members is not None:
                    idle = [f"{node}:{gpu}" for node, gpu in members.gpus
                            if _rank_in(plan, (node, gpu)) is None]
                    if idle:
                        print(f" adapt: GPUs idle in this plan, each a process waiting for a "
                              f"re-plan to use it: {', '.join(idle)}", flush=True)
            switch = _PlanSwitch(plan, rank, options, make_stop_check, adapter, previous,
                                 None if members is None else
                                 lambda g=generation: members.announce_training(g))
            last = train_job(plan, plan_label, model, options, rank=rank,
                             local_rank=local_rank, make_stop_check=switch.make_stop_check,
                             on_adapt=switch.decided, adapter=adapter, dashboard=dashboard,
                             idle_measured=(None if members is None else
                                            lambda p=plan: members.idle_measured(
                                                p, options.timeout / 2)))
            if switch.next is None:
                if members is not None and rank == 0:
                    members.announce(generation, {"finished": last})
                break
            adapter = None
            free_memory()       # train_job's trainer, optimizer and buffers are unreferenced
            saved_at = time.monotonic()
            new_rank = _rank_in(switch.next, plan.ranks[rank])
            dashboard, handover = _pass_dashboard(dashboard, rank, new_rank, options,
                                                  switch.group)
            if members is not None and rank == 0:
                now = time.monotonic()
                members.announce(generation, {
                    "plan": switch.next.to_dict(), "iteration": last,
                    "address": switch.address, "adapter": switch.adapter_state,
                    "move_s": switch.move_s, "dashboard": handover,
                    "written_unix": time.time(), "stopped_ago_s": now - switch.stopped_at,
                    "saved_ago_s": now - saved_at})
            backend = dist.get_backend()
            dist.destroy_process_group()
            if new_rank is None:
                if members is None:
                    return last
                plan, rank = switch.next, None
                options = resume_options(options, last)
                generation += 1
                continue
            store = switch.store or join_generation_store(*switch.address)
            dist.init_process_group(backend, rank=new_rank, world_size=switch.next.world_size,
                                    timeout=options.timeout,
                                    store=dist.PrefixStore(f"autohet/adapt/{generation}/",
                                                           store))
            previous = _Switched(plan, switch.next, last, switch.move_s, switch.stopped_at,
                                 saved_at, time.monotonic())
            plan, rank, plan_label = switch.next, new_rank, f"<re-plan at iteration {last}>"
            options, state = resume_options(options, last), switch.adapter_state
            generation += 1
    finally:
        if dashboard is not None:
            dashboard.close()
    if members is not None:
        members.finish(options.timeout)
    return last


def _pass_dashboard(dashboard, rank: int, new_rank: int | None, options: TrainOptions,
                    group):
    """At a switch, on every rank of the old plan (one broadcast on the switch's group, which
    also orders the old writer's close before the next one's first write): the dashboard stays
    with its process where that process is the new plan's rank 0 too; else the old rank 0
    hands it over (runtime/dashboard.py ``Dashboard.handover``) and the process that is the
    new rank 0 goes on with the same event file and W&B run: an old rank through this
    broadcast, a member idle in the old plan through the switch's announcement
    (:meth:`Members.announce`). Returns this process's dashboard for the new plan and the
    handover (the old rank 0's; None elsewhere)."""
    import torch.distributed as dist     # torch: a rank's code (see the module's docstring)

    message = [dashboard.handover() if rank == 0 and new_rank != 0 and dashboard else None]
    dist.broadcast_object_list(message, src=0, group=group)
    if new_rank != 0:
        return None, message[0] if rank == 0 else None
    return (dashboard if rank == 0 else job_dashboard(options, continues=message[0])), None
