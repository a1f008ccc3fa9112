"""Inputs of planning: the GPU catalog, a cluster, a model. YAML in, frozen dataclasses out."""

from megatron_autohet.spec.cluster import Cluster, Device, Node, load_cluster
from megatron_autohet.spec.gpus import GPUType, load_gpu_catalog
from megatron_autohet.spec.model import ModelSpec, load_model

__all__ = [
    "Cluster", "Device", "Node", "load_cluster",
    "GPUType", "load_gpu_catalog",
    "ModelSpec", "load_model",
]
