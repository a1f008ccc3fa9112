"""Inputs of planning: the GPU catalog, a cluster, a model. YAML in, frozen dataclasses out.

gpus       the GPU catalog (configs/gpus.yaml): datasheet figures per GPU type
cluster    a cluster: nodes, each with one GPU type and count, joined by a network
model      a GPT model's dimensions (configs/models/*.yaml)
precision  the numerics a job trains with: one definition for cost model, profiler, runtime
_yaml      reading a YAML mapping and typed fields, errors naming the file and the field
"""

from megatron_autohet.spec.cluster import Cluster, Device, Node, load_cluster
from megatron_autohet.spec.gpus import GPUType, load_gpu_catalog
from megatron_autohet.spec.model import ModelSpec, load_model

__all__ = [
    "Cluster", "Device", "Node", "load_cluster",
    "GPUType", "load_gpu_catalog",
    "ModelSpec", "load_model",
]
