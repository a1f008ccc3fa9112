"""Spot operations: notice watchers, preemption traces, elastic re-planning on torchrun.

Torch-free (no torch, megatron or boto3), so a watcher starts in a fraction of a second next to
the training job and runs where nothing else is installed.

notices   the preemption notice (a small JSON file), one watcher per source: AWS IMDSv2, GCP
          metadata, Azure Scheduled Events, signals (Kubernetes SIGTERM, Slurm --signal)
trace     preemption traces in the Bamboo/Oobleck format (``ms,add|remove,node``)
"""
