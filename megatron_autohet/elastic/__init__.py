"""Spot operations: notice watchers, preemption traces, elastic re-planning on torchrun.

notices   the preemption notice (a small JSON file), one watcher per source: AWS IMDSv2, GCP
          metadata, Azure Scheduled Events, signals (Kubernetes SIGTERM, Slurm --signal)
trace     preemption traces in the Bamboo/Oobleck format (``ms,add|remove,node``)
fleet     the nodes present after a (re)start as a cluster to plan for; workers -> plan ranks
events    the job's events as Megatron-style lines and JSON lines
stop      every rank stops after the same iteration on a signal or a notice, and saves it
handover  checkpoint files of nodes that will not train moved to nodes that will
worker    one worker of an elastic job under torchrun: discover, (re-)plan, recover, train

notices, trace, fleet and events are torch-free (a watcher starts in a fraction of a second next
to the training job, where nothing else is installed); the rest runs inside the training
processes.
"""
