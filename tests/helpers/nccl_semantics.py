"""NCCL's rule in multi-process CPU tests: a CPU tensor goes only over a gloo group.

The suite runs every process group on gloo, where a CPU tensor on the default group works. On
GPUs the default group is NCCL, which refuses CPU tensors ("No backend type associated with
device type cpu"), so such a call passes every CPU test and crashes on the first cluster.

Public API
----------
``nccl_semantics()`` (context manager, inside a process of dist_utils.run_on_ranks)
    While it is active, torch.distributed's tensor collectives and point-to-point calls raise
    :class:`NcclRefusal` for a CPU tensor on a group that was not created as gloo while it was
    active: the default group of the test harness (``None`` or ``dist.group.WORLD``), which
    stands for NCCL, or any group made without ``backend="gloo"``. Groups made with
    ``dist.new_group(backend="gloo")`` or a default group made with
    ``init_process_group("gloo")`` inside it are recorded as gloo. Yields a switch:
    ``strict.armed = False`` lets code the test does not examine (megatron-core's training on
    the harness's group) run unchecked. The ``*_object`` collectives are not checked: on NCCL
    they move their bytes to the current CUDA device themselves.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_CHECKED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
            "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
            "all_to_all_single", "send", "recv", "isend", "irecv")


class NcclRefusal(RuntimeError):
    """What NCCL would do with a CPU tensor: refuse it."""


@dataclass
class Strict:
    armed: bool = True
    gloo_groups: list = field(default_factory=list)   # groups created as gloo (kept alive)
    refused: list[str] = field(default_factory=list)

    def is_gloo(self, group) -> bool:
        group = dist.group.WORLD if group is None else group
        return any(group is g for g in self.gloo_groups)

    def check(self, name: str, tensors: list[torch.Tensor], group) -> None:
        if not self.armed or self.is_gloo(group):
            return
        if any(t.device.type == "cpu" for t in tensors):
            where = "the default group" if group is None or group is dist.group.WORLD else \
                "a group not created with backend='gloo'"
            self.refused.append(name)
            raise NcclRefusal(f"dist.{name}: a CPU tensor on {where}, which is NCCL on GPUs "
                              "(NCCL refuses CPU tensors: pass a gloo group)")


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _checked(strict: Strict, name: str, original):
    signature = inspect.signature(original)

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        tensors = [t for key, value in bound.arguments.items() if key != "group"
                   for t in _tensors(value)]
        strict.check(name, tensors, bound.arguments.get("group"))
        return original(*args, **kwargs)
    return call


@contextlib.contextmanager
def nccl_semantics():
    strict = Strict()
    originals = {name: getattr(dist, name) for name in _CHECKED}
    originals["batch_isend_irecv"] = dist.batch_isend_irecv
    originals["new_group"] = dist.new_group
    originals["init_process_group"] = dist.init_process_group

    def batch_isend_irecv(p2p_op_list):
        for op in p2p_op_list:
            strict.check("batch_isend_irecv", [op.tensor], op.group)
        return originals["batch_isend_irecv"](p2p_op_list)

    def new_group(*args, **kwargs):
        group = originals["new_group"](*args, **kwargs)
        backend = inspect.signature(originals["new_group"]).bind(*args, **kwargs) \
            .arguments.get("backend")
        if backend is not None and str(backend).lower() == "gloo":
            strict.gloo_groups.append(group)
        return group

    def init_process_group(*args, **kwargs):
        originals["init_process_group"](*args, **kwargs)
        backend = inspect.signature(originals["init_process_group"]).bind(*args, **kwargs) \
            .arguments.get("backend")
        if backend is not None and str(backend).lower() == "gloo":
            strict.gloo_groups.append(dist.group.WORLD)

    try:
        for name in _CHECKED:
            setattr(dist, name, _checked(strict, name, originals[name]))
        dist.batch_isend_irecv = batch_isend_irecv
        dist.new_group = new_group
        dist.init_process_group = init_process_group
        yield strict
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
