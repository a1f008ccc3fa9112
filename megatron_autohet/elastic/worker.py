"""One worker of an elastic job: ``autohet train --elastic`` started by torchrun's agents.

torchrun (torch.distributed.elastic) owns membership: its agents rendezvous, start one worker per
GPU, and on any failure or membership change stop every worker and start them again with new
ranks. It cannot see GPU types and its ranks are not stable, so on every (re)start the workers:

1. **Say who they are**: each worker puts its :class:`~megatron_autohet.elastic.fleet.Member`
   (node name, GPU type, GPU index) and, on a node's first GPU, the newest checkpoint step that
   node's disk holds (with the plan it was saved under) in the store torchrun gives the workers.
2. **Agree on a plan**: torchrun's rank 0 builds the cluster present from the members and the
   job's cluster file, takes the plan of the newest checkpoint (where the state is) or the
   job's ``--plan`` when there is none, keeps it when the fleet still fits it and re-plans
   otherwise, and publishes the plan. Every worker finds its plan rank by (node, GPU).
3. **Train**: a process group whose ranks are the plan's (same store, its own key prefix,
   ``--distributed-timeout-minutes``: a dead peer's closed connections fail a collective at
   once, the timeout bounds a hung one), recovery from the checkpoint tiers (own disk,
   surviving peers, S3), then the iteration loop with
   :class:`~megatron_autohet.elastic.stop.StopRequests`.
4. **Stop**: on a signal or a node's preemption notice every rank stops after the same
   iteration and saves it (and uploads it, with an S3 tier) before anyone exits.

   * A notice: the leaving node's files of that step go to the nodes that stay, and the staying
     ranks **re-plan in-process**: on the old process group the first staying rank re-plans
     (warm-started from the current plan) and opens a new store, one broadcast tells everyone,
     the leaving node's workers exit 0 (their agent waits in torchrun's exit barrier until the
     machine goes, and joins no new round), and the others build the new plan's process group and
     model in the same processes and recover the saved iteration from their disks. No worker
     restarts and no rendezvous round runs (the agents see nothing), so the job is down for
     about the save, the re-plan and the recovery, not for a restart. A GPU the new plan
     leaves idle (a V100 in a bf16 job) keeps its worker as a standby, as after a round.
   * A signal (torchrun stopping the workers because a node joins, or a failure elsewhere):
     every worker exits with :data:`EXIT_REPLAN`, and the agents start a new round (steps 1-3
     again, with new processes).

   So a preemption with notice or a join loses no iteration; a node lost without notice (its
   peers' collectives fail, the survivors exit, torchrun starts a new round) loses the
   iterations since the last save.
5. **Adapt** (``--autohet-adapt replan``): at a window's end whose decision (the plan's rank
   0's, planner/adapt.py) says SWITCH, every rank learns it and the new plan (plan_switch.py's
   switch agreement, wrapping the stop check above), stops after that iteration and saves it;
   the checkpoint files of nodes the new plan leaves idle go to nodes that train in it, on the
   old process group; the new plan's ranks make its process group in the same processes and
   recover that iteration, the decisions' hysteresis going on from the switch; the new plan's
   rank 0 times the switch and prices later ones at it, as ``autohet train``. The members do
   not change: a GPU the new plan leaves idle keeps its worker as a standby (below). A fleet
   change at the same iteration (a notice, a signal) wins over the switch: the decision priced
   the fleet that is changing, and the fleet's re-plan plans the fleet that stays.

A GPU the plan leaves idle keeps its worker waiting until the job ends (its agent stays in the
rendezvous, so the GPU is used at the next re-plan). When the fleet present has no plan (no GPU
that trains in the job's precision, none on which the model fits, a node the cluster file
contradicts), the rank that re-planned logs why and every worker learns it at once (in the store,
or the in-process broadcast) and stops the job for good with that line (:class:`NoPlan`): a new
round would find the same fleet.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_autohet.checkpoint.checkpointer import CheckpointStop
from megatron_autohet.checkpoint.inspect import committed_s3, newest_manifest
from megatron_autohet.checkpoint.deadline import Deadline, against
from megatron_autohet.checkpoint.manifest import (MANIFEST_FILE, Manifest, read_manifest,
                                                  step_dir_name)
from megatron_autohet.checkpoint.options import object_store
from megatron_autohet.checkpoint.sources import StoreError
from megatron_autohet.checkpoint.upload import upload_step
from megatron_autohet.checkpoint.writer import SaveFailed
from megatron_autohet.elastic.events import EventLog
from megatron_autohet.elastic.fleet import Member, fleet_cluster, gpu_type_of_device, plan_ranks
from megatron_autohet.elastic.handover import Moved, hand_over, move_files
from megatron_autohet.elastic.hold import hold_file_from_env, wait_while_held
from megatron_autohet.elastic.rendezvous import stop_for_good
from megatron_autohet.elastic.stop import StopDecision, StopRequests, stop_group
from megatron_autohet.errors import ConfigError, JobConfigError
from megatron_autohet.job import init_backend, job_dashboard, job_precision, train_job
from megatron_autohet.plan import Plan, plan_from_dict
# _PlanSwitch: autohet train's switch agreement, one decision protocol for both front ends
from megatron_autohet.plan_switch import (_PlanSwitch, _Switched, host_generation_store,
                                          join_generation_store)
from megatron_autohet.planner.adapt import Adapter
from megatron_autohet.planner.replan import replan
from megatron_autohet.runtime.cpu_mode import cpu_mode_required
from megatron_autohet.runtime.device import device_index, free_memory, select_device
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.gpus import load_gpu_catalog
from megatron_autohet.spec.model import ModelSpec

# Exit status of a worker that stopped for a re-plan (torchrun restarts it in a new round).
EXIT_REPLAN = 75
# Seconds before a notice's deadline that no copy may use: the leaving ranks still take part in
# the in-process re-plan's broadcast, then exit.
EXIT_RESERVE_S = 5.0
_PREFIX = "autohet/"
_STORE_TIMEOUT = timedelta(minutes=5)   # waiting for every worker to say who it is


def node_identity(local_rank: int, gpu_catalog: str | None = None) -> tuple[str, str]:
    """(node name, GPU type): ``AUTOHET_NODE`` / ``AUTOHET_GPU`` where set (launch_node.sh sets
    them; emulated nodes must), else the hostname and the CUDA device name matched to the
    catalog: the job's ``--gpu-catalog`` (``gpu_catalog``), else the bundled one."""
    node = os.environ.get("AUTOHET_NODE") or socket.gethostname()
    gpu = os.environ.get("AUTOHET_GPU")
    catalog = sorted(load_gpu_catalog(gpu_catalog))
    if gpu is None:
        if not torch.cuda.is_available():
            raise ConfigError("<environment>", "AUTOHET_GPU", "not set and this process has no "
                              "GPU to detect", f"a GPU type of the catalog: {', '.join(catalog)}")
        name = torch.cuda.get_device_name(device_index(local_rank, torch.cuda.device_count()))
        gpu = gpu_type_of_device(name, catalog)
        if gpu is None:
            raise ConfigError("<environment>", "AUTOHET_GPU", f"device {name!r} matches no "
                              "catalog type", f"set AUTOHET_GPU to one of {', '.join(catalog)}")
    elif gpu not in catalog:
        raise ConfigError("<environment>", "AUTOHET_GPU", f"unknown GPU type {gpu!r}",
                          ", ".join(catalog))
    return node, gpu


def _worker_store(rank: int):
    """The store torchrun names for the workers (MASTER_ADDR/MASTER_PORT): hosted by worker 0
    unless the agent shares its own (TORCHELASTIC_USE_AGENT_STORE)."""
    host_here = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=host_here, timeout=_STORE_TIMEOUT, wait_for_workers=False)


def _local_step(local_dir: str | None, node: str) -> dict | None:
    """The newest committed step on this node's disk: {"iteration", "plan"}, or None."""
    if local_dir is None:
        return None
    found = newest_manifest(local_dir.replace("{node}", node))
    if found is None:
        return None
    step, manifest = found
    return {"iteration": manifest.iteration, "plan": manifest.plan}


def _s3_step(options) -> dict | None:
    """The newest step committed in S3 (its plan), when no disk has one."""
    store = object_store(options)
    if store is None:
        return None
    try:
        steps = committed_s3(store)
        if not steps:
            return None
        raw = store.get_bytes(f"{step_dir_name(steps[-1])}/{MANIFEST_FILE}")
    except StoreError:
        return None
    manifest = Manifest.from_json(raw, store.location.uri(f"{step_dir_name(steps[-1])}/"
                                                          f"{MANIFEST_FILE}"))
    return {"iteration": manifest.iteration, "plan": manifest.plan}


@dataclass(frozen=True)
class _Adapted:
    """An adapt switch agreed and its iteration saved: the next generation's plan on the same
    members, the store its process group meets on (None: idle in it), the hysteresis and the
    switch's times so far (the new plan's rank 0 times it, as autohet train's)."""
    plan: Plan
    store: object
    adapter_state: dict
    switched: _Switched


@dataclass(frozen=True)
class _Ended:
    """How a generation (one plan in this process) ended, in plain values."""
    last: int                           # the last iteration trained
    decision: StopDecision | None       # None: the job trained to its end (or adapted)
    warm: tuple | None                  # after an in-process re-plan: (plan, members, store, host)
    adapted: _Adapted | None = None     # after an adapt switch


class NoPlan(Exception):
    """The fleet present has no plan (the re-plan's ConfigError); ``line`` says why and where the
    training state is. Every worker of the job raises it together and stops the job for good."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


class ElasticWorker:
    def __init__(self, *, initial_plan: Plan, template: Cluster, model: ModelSpec, options,
                 notice_file: str | None, events_jsonl: str | None):
        self.started = time.monotonic()
        self.initial_plan = initial_plan
        self.template = template
        self.model = model
        self.options = options
        self.notice_template = notice_file
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        node, gpu = node_identity(self.local_rank, options.gpu_catalog)
        self.me = Member(node, gpu, self.local_rank)
        self.events_jsonl = events_jsonl
        # TensorBoard / W&B of this process: its events and, on the plan's rank 0, iterations
        self.dashboard = job_dashboard(options)
        self.events = self._log(self.rank == 0)

    def _log(self, reporting: bool) -> EventLog:
        """The job's event log, written only where ``reporting`` (one rank at a time)."""
        return EventLog(self.events_jsonl, enabled=reporting, node=self.me.node,
                        sink=self.dashboard and self.dashboard.event)

    # ---- 1-2: who is here, which plan ----------------------------------------------------

    def agree(self, store) -> tuple[Plan, list[Member], list[int | None]]:
        ckpt = self.options.checkpoint
        said = {"member": self.me.to_dict(),
                "step": _local_step(ckpt.local_dir, self.me.node) if self.local_rank == 0
                else None}
        store.set(f"{_PREFIX}member/{self.rank}", json.dumps(said))
        if self.rank == 0:
            start = time.monotonic()
            keys = [f"{_PREFIX}member/{r}" for r in range(self.world_size)]
            store.wait(keys)
            told = [json.loads(store.get(k)) for k in keys]
            members = [Member.from_dict(t["member"]) for t in told]
            try:
                plan, decision = self._decide(members, [t["step"] for t in told if t["step"]])
            except NoPlan as failed:                # the others learn it in the plan's place
                store.set(f"{_PREFIX}plan", json.dumps({"no_plan": failed.line}))
                raise
            store.set(f"{_PREFIX}plan", json.dumps(plan.to_dict()))
            idle = [f"{m.node}:{m.local_rank}" for m, r in zip(members, plan_ranks(plan, members))
                    if r is None]
            self._emit_plan(decision, members, plan, time.monotonic() - start, idle=idle)
        else:
            store.wait([f"{_PREFIX}plan"])
        said = json.loads(store.get(f"{_PREFIX}plan"))
        if "no_plan" in said:
            raise NoPlan(said["no_plan"])
        plan = plan_from_dict(said, "<elastic plan>")
        members = [Member.from_dict(json.loads(store.get(f"{_PREFIX}member/{r}"))["member"])
                   for r in range(self.world_size)]
        return plan, members, plan_ranks(plan, members)

    def _emit_plan(self, decision: str, members: list[Member], plan: Plan, seconds: float, *,
                   idle: list[str] = (), warm: bool = False, detail: str = "") -> None:
        nodes = sorted({m.node for m in members})
        self.events.emit(
            "plan", f"{decision} for {len(members)} GPUs on {len(nodes)} nodes: "
            f"{plan.world_size} ranks in {len(plan.pipelines)} pipeline(s)" + detail
            + (f", idle: {', '.join(idle)}" if idle else "") + f" ({seconds:.2f} s)",
            decision=decision, seconds=round(seconds, 3), nodes=nodes,
            world_size=plan.world_size, pipelines=len(plan.pipelines), idle=list(idle),
            restart=int(self.round), **({"warm": True} if warm else {}))

    def _zoned_fleet(self, plan: Plan) -> Cluster | None:
        """The plan's nodes with their zones, on a cluster file across zones (recovery asks
        the same zone's peers first); None without zones."""
        if not self.template.regions:
            return None
        return fleet_cluster([Member(r.node, r.gpu, r.local_rank) for r in plan.ranks],
                             self.template)

    def _emit_fleet(self, cluster: Cluster, gone: list[str], joined: list[str]) -> None:
        self.events.emit("fleet", ", ".join(f"{n.name} ({n.num_gpus} x {n.gpu})"
                                            for n in cluster.nodes)
                         + (f"; gone: {', '.join(gone)}" if gone else "")
                         + (f"; new: {', '.join(joined)}" if joined else ""),
                         nodes={n.name: {"gpu": n.gpu, "gpus": n.num_gpus}
                                for n in cluster.nodes}, gone=gone, joined=joined)

    def _decide(self, members: list[Member], steps: list[dict]) -> tuple[Plan, str]:
        newest = max(steps, key=lambda s: s["iteration"], default=None) or \
            _s3_step(self.options.checkpoint)
        state = (f"the newest checkpoint step is {newest['iteration']}" if newest
                 else "no checkpoint step yet")
        # A node whose GPU the cluster file contradicts or lacks, a step's plan that does not
        # load: no plan either.
        try:
            cluster = fleet_cluster(members, self.template)
            previous = (plan_from_dict(newest["plan"], f"<plan of step {newest['iteration']}>")
                        if newest else self.initial_plan)
        except ConfigError as err:
            counts = Counter((m.node, m.gpu) for m in members)
            raise self._no_plan([(n, c, g) for (n, g), c in counts.items()], err, state) from None
        # Against the plan the state was saved under: which nodes are gone, which are new.
        before = {info.node for info in previous.ranks}
        present = {n.name for n in cluster.nodes}
        gone, joined = sorted(before - present), sorted(present - before)
        self._emit_fleet(cluster, gone, joined)
        found = self._replan(previous, cluster, state)
        source = f"step {newest['iteration']}'s plan" if newest else "the initial plan"
        if found.unchanged:
            return found.plan, f"kept {source}"
        return found.plan, (f"re-planned from {source} (predicted iteration "
                            f"{found.cost.iteration_time_s:.3g} s, recovery moves "
                            f"{found.recovery_bytes / 2**20:.1f} MiB across nodes)")

    def _replan(self, previous: Plan, cluster: Cluster, state: str):
        """planner/replan.py's re-plan for the fleet present, on the GPUs that can train in this
        job's precision (a bf16 job leaves V100s and T4s idle, as ``autohet plan`` does and
        ``autohet train`` demands). No plan: :class:`NoPlan` (:meth:`_no_plan`). A plan whose
        cost objective the fleet cannot keep is re-planned as the fastest, which is logged here,
        on the one rank that plans."""
        try:
            found = replan(previous, cluster, self.model,
                           precision=job_precision(self.options)[0].name, cluster_file="<fleet>")
        except ConfigError as err:
            raise self._no_plan([(n.name, n.num_gpus, n.gpu) for n in cluster.nodes], err,
                                state) from None
        if found.objective_warning:
            self._log(True).emit("objective", found.objective_warning, kept=False,
                                 note=found.objective_note)
        return found

    def _no_plan(self, fleet: list[tuple[str, int, str]], err: ConfigError, state: str) -> NoPlan:
        """No plan for ``fleet`` (node, GPUs, GPU type): logged here, on the one rank that
        plans (``state``: where the training state is)."""
        nodes = ", ".join(f"{node} ({count} x {gpu})" for node, count, gpu in fleet)
        line = f"no plan for the fleet present, {nodes}: {err}; the job stops ({state})"
        self._log(True).emit("no_plan", line, nodes=[node for node, _, _ in fleet],
                             error=str(err))
        return NoPlan(line)

    # ---- 3-4: train, stop -------------------------------------------------------------------

    def run(self) -> int:
        try:
            return self._run()
        finally:
            if self.dashboard is not None:
                self.dashboard.close()

    def _run(self) -> int:
        store = _worker_store(self.rank)
        try:
            plan, members, _ = self.agree(store)
        except NoPlan as failed:
            return stop_for_good(failed.line)
        on_cpu = cpu_mode_required()
        # Who hosts the store the workers finish on (members: the workers that finish the job).
        store_host = self.rank == 0
        generation = 0
        # The store the generation's process group meets on (an adapt switch's own, hosted by a
        # rank of the new plan: the members' store stays the one the standbys wait on), and the
        # adaptation's hysteresis an adapt switch carries over.
        group_store, adapter_state, adapted, switched = store, None, False, None
        while True:
            ranks = plan_ranks(plan, members)
            plan_rank = ranks[members.index(self.me)]
            # From here on the plan's rank 0 reports (torchrun's rank 0 may be idle).
            self.events = self._log(plan_rank == 0)
            if None in ranks and not adapted:
                # (after an adapt switch the old plan's ranks moved the files already: the
                # standbys of before wait in _idle and take part in no handover)
                self._hand_over(store, plan, members)
            if plan_rank is None:
                return self._idle(store, host=store_host, expected=len(members))
            if generation == 0:
                hold = hold_file_from_env()
                if hold is not None:
                    # A test holding the job before it trains (elastic/hold.py): torchrun's
                    # SIGTERM, its default action still, ends the wait with this process.
                    wait_while_held(hold, 0, lambda: False)
                init_backend(on_cpu)
                if not on_cpu:
                    select_device(self.local_rank)
            dist.init_process_group("gloo" if on_cpu else "nccl", rank=plan_rank,
                                    world_size=plan.world_size, timeout=self.options.timeout,
                                    store=dist.PrefixStore(f"{_PREFIX}train/{generation}/",
                                                           group_store))
            if switched is not None:        # an adapt switch's new process group is made
                switched = replace(switched, grouped_at=time.monotonic())
            try:
                ended = self._generation(plan, plan_rank, members, adapter_state, switched)
            except JobConfigError as err:
                # Every rank raised it from the same plan, flags and steps (no step the fleet
                # present can serve: a node lost without notice held the only copy of its
                # files): a restart would raise it again, for ever.
                return stop_for_good(f"{err}")
            except CheckpointStop as stop:          # not restarted: torchrun would
                return stop_for_good(stop.line)
            except NoPlan as failed:
                return stop_for_good(failed.line)
            finally:
                dist.destroy_process_group()
            adapted = ended.adapted is not None
            switched = ended.adapted.switched if adapted else None
            if adapted:
                plan, group_store = ended.adapted.plan, ended.adapted.store
                adapter_state = ended.adapted.adapter_state
            elif ended.decision is None:
                self._finish(store, ended.last if plan_rank == 0 else None, host=store_host,
                             expected=len(members))
                return 0
            elif ended.decision.leaving:
                # Leave the job: with all its workers done, our agent waits in torchrun's exit
                # barrier (counted there, so the others' barrier at the job's end completes)
                # until the machine goes; it takes part in no further rendezvous round.
                return 0
            elif ended.warm is None:
                return EXIT_REPLAN
            else:
                plan, members, store, store_host = ended.warm
                group_store, adapter_state = store, None
            generation += 1

    def _drift_event(self, report) -> None:
        """Every measurement window (runtime/stage_drift.py ``WindowReport``, on the plan's rank
        0): one ``drift`` event, naming the stages more than 10% off their predictions."""
        message, fields = report.event()
        self.events.emit("drift", message, **fields)

    def _adapt_event(self, decision) -> None:
        """Every window's adaptation decision (planner/adapt.py ``AdaptDecision``, with
        ``--autohet-adapt log`` or ``replan``, on the plan's rank 0): one ``adapt`` event."""
        message, fields = decision.event()
        self.events.emit("adapt", message, **fields)

    def _generation(self, plan: Plan, plan_rank: int, members: list[Member],
                    adapter_state: dict | None = None,
                    previous: _Switched | None = None) -> _Ended:
        """Train ``plan`` on the initialised default group until the job ends or stops; after a
        notice, evacuate and re-plan on that group; after an adapt switch, hand the idle nodes'
        files over on it (:meth:`_adapt_switch`). What it returns holds nothing of the
        generation's model: its trainer, optimizer and buffers are freed before the files move
        and the re-plan, so the next generation in this process starts from the memory the
        first one had (survivors that take more layers need it). ``adapter_state``: the
        adaptation's hysteresis so far (``--autohet-adapt replan``; None: a new one);
        ``previous``: the adapt switch this generation follows, which its rank 0 times after its
        first iteration (plan_switch.py ``SwitchTiming``: later switches priced at it)."""
        stop = None

        def make_stop_check(checkpointer):
            nonlocal stop
            stop = _StopCheck(self, checkpointer)
            return stop
        switch, adapter, on_adapt, switched = None, None, self._adapt_event, []
        if self.options.adapt == "replan" and self.options.measure_window:
            # the plan's rank 0 decides (job.adapt_sink), every rank learns it (_PlanSwitch)
            adapter = Adapter(**(adapter_state or {})) if plan_rank == 0 else None
            switch = _PlanSwitch(plan, plan_rank, self.options, make_stop_check, adapter,
                                 previous)

            def on_adapt(decision):
                self._adapt_event(decision)
                if decision.switch:
                    switched.append(decision)       # for the switch's plan event
                switch.decided(decision)
        last = train_job(plan, "<elastic plan>", self.model, self.options, rank=plan_rank,
                         local_rank=self.local_rank,
                         make_stop_check=switch.make_stop_check if switch else make_stop_check,
                         on_window=self._drift_event, on_adapt=on_adapt, adapter=adapter,
                         dashboard=self.dashboard, cluster=self._zoned_fleet(plan))
        decision = stop.requests.decision if stop is not None else None
        if decision is None and switch is not None and switch.next is not None:
            group, stopped_at = stop.requests.group, switch.stopped_at
            stop = None             # the last reference to the checkpointer, hence the trainer
            return self._adapt_switch(plan, plan_rank, members, last, switch, group, stopped_at,
                                      switched[-1:])
        if decision is None:
            return _Ended(last, None, None)
        seconds = time.monotonic() - stop.stopped_at
        leaving_nodes, group = stop.leaving_nodes, stop.requests.group
        deadline = stop.deadline
        self.events.emit("saved", f"iteration {last} saved on every node {seconds:.2f} s after "
                         "the stop" + (" (S3: after the evacuation)" if deadline and
                                       self.options.checkpoint.s3_uri else "")
                         + against(deadline), iteration=last, seconds=round(seconds, 3),
                         **_to_deadline(deadline))
        stop = None                 # the last reference to the checkpointer, hence the trainer
        free_memory()
        warm = None
        if leaving_nodes:
            moved = self._evacuate(plan, plan_rank, decision.leaving, group, deadline)
            if deadline is not None:
                self._upload_stranded(last, plan, plan_rank, leaving_nodes, moved, group,
                                      deadline)
            # (with a standby - a worker outside this group, waiting in _idle - only a new
            # round reaches every worker: EXIT_REPLAN)
            if not decision.signalled and len(members) == plan.world_size:
                warm = self._replan_in_process(plan, plan_rank, members, leaving_nodes, last)
        return _Ended(last, decision, warm)

    def _adapt_switch(self, plan: Plan, plan_rank: int, members: list[Member], last: int,
                      switch: _PlanSwitch, group, stopped_at: float, decided: list) -> _Ended:
        """After an adapt switch's save of ``last``, on the old process group (``group``: the
        stop check's, of every plan rank): the ``saved`` event, the files of nodes the new plan
        leaves idle to nodes that train in it (as a round's handover: recovery reads the
        training ranks' disks), the ``plan`` event (the old plan's rank 0, with the decision
        it took: ``decided``), and the new generation's store, joined by its ranks."""
        new, seconds = switch.next, time.monotonic() - stopped_at
        self.events.emit("saved", f"iteration {last} saved on every node {seconds:.2f} s after "
                         "the switch's stop", iteration=last, seconds=round(seconds, 3))
        free_memory()
        training = {info.node for info in new.ranks}
        idle_nodes = sorted({info.node for info in plan.ranks} - training)
        if idle_nodes:
            start = time.monotonic()
            first_of_node = min(i.rank for i in plan.ranks if i.node == self.me.node) == plan_rank
            moved = move_files(self._local_root(), rank=plan_rank, speaks_for_node=first_of_node,
                               receives=self.me.node in training, group=group)
            self._emit_handover(idle_nodes, moved.bytes, start)
        ranks = plan_ranks(new, members)
        idle = [f"{m.node}:{m.local_rank}" for m, r in zip(members, ranks) if r is None]
        for decision in decided:        # on the old plan's rank 0, which decided
            self._emit_plan("adapted in-process", members, new, decision.search_s, idle=idle,
                            warm=True, detail=f" after iteration {last}, predicted iteration "
                            f"{decision.new_s:.3g} s against {decision.current_s:.3g} s")
        self.started = time.monotonic()
        # the state is saved and where the new plan reads it: the new process group is next
        switched = _Switched(plan, new, last, switch.move_s, stopped_at, self.started, 0.0)
        store = switch.store
        if store is None and ranks[members.index(self.me)] is not None:
            store = join_generation_store(*switch.address, _STORE_TIMEOUT)
        return _Ended(last, None, None, _Adapted(new, store, switch.adapter_state, switched))

    def _replan_in_process(self, plan: Plan, plan_rank: int, members: list[Member],
                           leaving: list[str], iteration: int):
        """After a notice, on the old process group: the nodes that stay go on in this process
        - no new workers, no new rendezvous. The first staying rank re-plans for them and hosts
        a new store; everyone learns both, or why there is no plan (:class:`NoPlan`, raised on
        every rank), by one broadcast. Returns (plan, members, store, hosting) for the staying
        ranks - a GPU the new plan leaves idle among them, its worker a standby (run) - and
        None for the leaving ones."""
        start = time.monotonic()
        by_rank = {r: m for r, m in zip(plan_ranks(plan, members), members)}
        staying = [by_rank[r] for r in sorted(by_rank) if by_rank[r].node not in leaving]
        if not staying:
            return None
        host = next(r for r in sorted(by_rank) if by_rank[r].node not in leaving)
        message = [None]
        server = None
        cluster = fleet_cluster(staying, self.template)
        if plan_rank == host:
            try:
                found = self._replan(plan, cluster, f"iteration {iteration} is saved on "
                                     f"{', '.join(n.name for n in cluster.nodes)}")
            except NoPlan as failed:
                message = [{"no_plan": failed.line}]
            else:
                # the store --autohet-adapt replan's switch meets on too (job.py)
                server, addr, port = host_generation_store(_STORE_TIMEOUT)
                message = [{"plan": found.plan.to_dict(), "addr": addr, "port": port,
                            "recovery_bytes": found.recovery_bytes,
                            "iteration_time_s": found.cost.iteration_time_s}]
        dist.broadcast_object_list(message, src=host)
        if "no_plan" in message[0]:
            raise NoPlan(message[0]["no_plan"])
        if self.me.node in leaving:
            return None
        new = plan_from_dict(message[0]["plan"], "<elastic plan>")
        store = server or join_generation_store(message[0]["addr"], message[0]["port"],
                                                _STORE_TIMEOUT)
        seconds = time.monotonic() - start
        self.started = time.monotonic()
        # The host reports the re-plan: the old plan's rank 0, which reported until now, may be
        # on a node that leaves. From the new generation on the new plan's rank 0 reports.
        self.events = self._log(plan_rank == host)
        if plan_rank == host:
            idle = [f"{m.node}:{m.local_rank}" for m, r in zip(staying, plan_ranks(new, staying))
                    if r is None]
            self._emit_fleet(cluster, leaving, [])
            self._emit_plan("re-planned in-process", staying, new, seconds, idle=idle, warm=True,
                            detail=f", predicted iteration {message[0]['iteration_time_s']:.3g}"
                            f" s, recovery moves {message[0]['recovery_bytes'] / 2**20:.1f} "
                            "MiB across nodes")
        return new, staying, store, server is not None

    def _evacuate(self, plan: Plan, plan_rank: int, leaving: bool, group,
                  deadline: Deadline | None) -> Moved:
        """After the emergency save: files of the step that only leaving nodes hold go to the
        nodes that stay, over ``group`` (the stop check's gloo group of every plan rank: the
        files travel as CPU tensors); with ``deadline``, those that can arrive before it."""
        start = time.monotonic()
        first_of_node = min(i.rank for i in plan.ranks if i.node == self.me.node) == plan_rank
        moved = move_files(self._local_root(), rank=plan_rank, speaks_for_node=first_of_node,
                           receives=not leaving, group=group, deadline=deadline)
        seconds = time.monotonic() - start
        skipped = [f"{t.name} ({t.size / 2**20:.1f} MiB)" for t in moved.skipped]
        self.events.emit("evacuate", f"{moved.bytes / 2**20:.1f} MiB that only leaving nodes "
                         f"held copied to the nodes that stay in {seconds:.2f} s"
                         + (f"; not started, too late for the deadline: {', '.join(skipped)}"
                            if skipped else "") + against(deadline),
                         bytes=moved.bytes, seconds=round(seconds, 3),
                         skipped=[t.name for t in moved.skipped], **_to_deadline(deadline))
        return moved

    def _upload_stranded(self, iteration: int, plan: Plan, plan_rank: int, leaving: list[str],
                         moved: Moved, group, deadline: Deadline) -> None:
        """After the evacuation before a deadline: S3 gets the step when some of its files are
        still on leaving nodes only (too late for the peers, or no node stays), as far as the
        deadline allows; a step on the staying nodes' disks waits for their next save (its
        upload would only keep them waiting)."""
        staying = sorted({i.node for i in plan.ranks} - set(leaving))
        stranded = [t.name for t in moved.skipped]
        options = self.options.checkpoint
        if staying and not stranded:
            if options.s3_uri is not None:
                self.events.emit("upload", f"iteration {iteration} not uploaded to S3 before "
                                 f"the deadline: not needed, every file of it is on the disks "
                                 f"of {', '.join(staying)}, whose next save uploads"
                                 + against(deadline), iteration=iteration, needed=False,
                                 committed=False, skipped=[], **_to_deadline(deadline))
            return
        where = ("only on leaving nodes: " + ", ".join(stranded) if stranded
                 else "no node stays")
        if options.s3_uri is None:
            self.events.emit("upload", f"iteration {iteration}: no S3 tier, and files of it "
                             f"are lost with the leaving nodes ({where})" + against(deadline),
                             iteration=iteration, needed=True, committed=False,
                             skipped=stranded, **_to_deadline(deadline))
            return
        start = time.monotonic()
        step = self._local_root() / step_dir_name(iteration)
        try:
            done = upload_step(object_store(options), read_manifest(step), step, rank=plan_rank,
                               keep=options.keep, group=group, deadline=deadline)
        except SaveFailed as err:
            self.events.emit("upload", f"iteration {iteration} ({where}): {err}"
                             + against(deadline), iteration=iteration, needed=True,
                             committed=False, error=str(err), **_to_deadline(deadline))
            return
        seconds = time.monotonic() - start
        skipped = "; ".join(f"{s.name} ({s.size / 2**20:.1f} MiB, rank {s.rank}): {s.why}"
                            for s in done.skipped)
        self.events.emit("upload", f"iteration {iteration} ({where}): "
                         + ("committed in S3" if done.committed else "not committed in S3")
                         + f", {done.bytes / 2**20:.1f} MiB sent in {seconds:.2f} s"
                         + (f"; skipped: {skipped}" if skipped else "")
                         + (f"; another save committed it already ({done.taken}), whose files "
                            "are kept" if done.taken else "") + against(deadline),
                         iteration=iteration, needed=True, committed=done.committed,
                         bytes=done.bytes, seconds=round(seconds, 3),
                         skipped=[s.name for s in done.skipped], **_to_deadline(deadline))

    def _local_root(self) -> Path:
        return Path(self.options.checkpoint.local_dir.replace("{node}", self.me.node))

    def _hand_over(self, store, plan: Plan, members: list[Member]) -> None:
        """Some GPUs are idle in this plan: their nodes' files go to training nodes first."""
        start = time.monotonic()
        training_nodes = {info.node for info in plan.ranks}
        local_dir = self.options.checkpoint.local_dir
        moved = hand_over(store, rank=members.index(self.me), world_size=len(members),
                             speaks_for_node=self.local_rank == 0,
                             training=self.me.node in training_nodes,
                             root=Path(local_dir.replace("{node}", self.me.node)),
                             timeout=self.options.timeout)
        idle = sorted({m.node for m in members} - training_nodes)
        if idle:
            self._emit_handover(idle, moved, start)

    def _emit_handover(self, idle: list[str], moved: int, start: float) -> None:
        self.events.emit("handover", f"{moved / 2**20:.1f} MiB of checkpoint files that "
                         f"only idle node(s) {', '.join(idle)} held sent to training nodes "
                         f"in {time.monotonic() - start:.2f} s", idle_nodes=idle,
                         bytes=moved, seconds=round(time.monotonic() - start, 3))

    def _idle(self, store, *, host: bool, expected: int) -> int:
        """A standby: wait for the job's end, then finish (:meth:`_finish`). It has nothing to
        save, so torchrun's SIGTERM (a new round) ends it at once, by the signal's default
        action: a generation it trained before (an adapt switch or a notice left it idle) had
        that signal only recorded, for a stop check no standby runs."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            try:
                store.wait([f"{_PREFIX}finished"], timedelta(minutes=1))
                break
            except dist.DistStoreError as err:  # a timeout: keep waiting (a lost store is a
                if "timeout" not in str(err).lower():   # DistNetworkError: we restart with it)
                    raise
        self._finish(store, None, host=host, expected=expected)
        return 0

    def _finish(self, store, last: int | None, *, host: bool, expected: int) -> None:
        """The job trained to its end: plan rank 0 says so (``last``), idle workers heard it;
        every worker counts itself done and the worker hosting the store waits for all
        ``expected`` (bounded: an idle node that died meanwhile never counts itself)."""
        if last is not None:
            store.set(f"{_PREFIX}finished", "1")
            self.events.emit("finished", f"trained to iteration {last}", iteration=last)
        store.add(f"{_PREFIX}done", 1)
        if host:
            deadline = time.monotonic() + _STORE_TIMEOUT.total_seconds()
            while store.add(f"{_PREFIX}done", 0) < expected and time.monotonic() < deadline:
                time.sleep(0.05)


def _to_deadline(deadline: Deadline | None) -> dict:
    """An event's JSON field: seconds left to the notice's deadline when it was logged."""
    return {} if deadline is None else {"to_deadline_s": round(deadline.to_deadline(), 3)}


class _StopCheck:
    """The stop check of an elastic job, also reporting recovery and the first iteration."""

    def __init__(self, worker: ElasticWorker, checkpointer):
        self.worker = worker
        self.checkpointer = checkpointer
        notice = worker.notice_template
        self.requests = StopRequests(
            stop_group(worker.options.timeout),
            notice_file=notice.replace("{node}", worker.me.node) if notice else None)
        self.first = True
        self.leaving_nodes: list[str] = []
        self.deadline: Deadline | None = None     # of the leaving nodes' notices
        self.stopped_at: float | None = None      # time.monotonic() of the stop decision

    def __call__(self, iteration: int) -> str | None:
        events = self.worker.events
        if self.first:
            self.first = False
            report = self.checkpointer.last_report if self.checkpointer else None
            if report is not None:
                events.emit("recovery", report.line(), iteration=report.iteration,
                            **report.event_fields())
            seconds = time.monotonic() - self.worker.started
            events.emit("first_iteration", f"iteration {iteration} done {seconds:.2f} s after "
                        "this (re)start began", iteration=iteration, seconds=round(seconds, 3))
        hold = hold_file_from_env()
        if hold is not None:        # a test making a fleet event land after a known iteration
            wait_while_held(hold, iteration, lambda: self.requests.signal_received is not None)
        action = self.requests.check(iteration)
        if action == "stop":
            self.stopped_at = time.monotonic()
            self._report_stop(iteration)
        return action

    def _report_stop(self, iteration: int) -> None:
        decision = self.requests.decision
        leaving = [None] * dist.get_world_size()
        dist.all_gather_object(leaving, self.worker.me.node if decision.leaving else None,
                               group=self.requests.group)
        nodes = sorted({n for n in leaving if n})
        self.leaving_nodes = nodes
        if nodes and decision.deadline_unix is not None:
            self.deadline = Deadline(decision.deadline_unix, EXIT_RESERVE_S)
            if self.checkpointer is not None:
                # Peers first: S3 waits until after the evacuation (worker._generation)
                self.checkpointer.stop_uploading()
        why = (f"preemption notice on {', '.join(nodes)}: saving iteration {iteration}, then "
               f"{', '.join(nodes)} leave(s)" if nodes else
               f"signal: saving iteration {iteration} before the restart")
        self.worker.events.emit("stop", why + against(self.deadline),
                                iteration=iteration, reason="notice" if nodes else "signal",
                                leaving=nodes, deadline_unix=decision.deadline_unix,
                                **_to_deadline(self.deadline))
