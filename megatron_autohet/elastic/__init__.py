"""Spot operations: notice watchers, membership on torchrun, elastic re-planning.

notices     the preemption notice (a small JSON file), one watcher per source: AWS IMDSv2, GCP
            metadata, Azure Scheduled Events, signals (Kubernetes SIGTERM, Slurm --signal)
rendezvous  `autohet node`'s rendezvous backend: torchrun's c10d, a failed round rejoined, a
            member lost without notice ending the round at once
liveness    when a member's lapsed keep-alive is a loss, not a busy node: confirmed over the
            loss timeout across polls, never an agent's own lapse (pure)
fleet       the nodes present after a (re)start as a cluster to plan for; workers -> plan ranks
events      the job's events as Megatron-style lines and JSON lines
stop        every rank stops after the same iteration on a signal or a notice, and saves it
hold        holding a job at an iteration boundary, so a fleet event lands after it (tests)
handover    checkpoint files of nodes that will not train moved to nodes that will
worker      one worker of an elastic job under torchrun: discover, (re-)plan, recover, train

(preemption traces, read by the benchmarks and tests, are testing/trace.py.) notices, liveness,
fleet and events are torch-free (a watcher starts in a fraction of a second next
to the training job, where nothing else is installed); the rest runs inside the training
processes.
"""
