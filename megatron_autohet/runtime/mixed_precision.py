"""Megatron-LM's mixed precision on this runtime: the torch dtypes of spec/precision.py and the
fp32 master weights the optimizer steps.

Public API
----------
``param_dtype(precision) -> torch.dtype``
    The dtype of the layers' weights and activations (``TransformerConfig.params_dtype`` and
    ``pipeline_dtype``) for a :class:`~megatron_autohet.spec.precision.Precision`.
``MAIN_GRAD_DTYPE``
    fp32: the dtype gradients are accumulated, reduced, normed and clipped in (runtime/grad_sync.py
    allocates its buckets in it).
``MASTER_KEY``
    ``"fp32_param"``: megatron-core's optimizer-state key of a master weight.
``MasterWeights(named_params, precision)``
    The tensors the optimizer steps, one per trainable parameter, keyed by local name: a 16-bit
    parameter gets an fp32 copy, an fp32 parameter is its own master. Each master's ``.grad`` is
    the parameter's ``main_grad`` (set by GradSync, or by the reference's own accumulation);
    ``use_main_grads()`` points them there again after something set an fp32 ``.grad`` to None.
    ``write_back()`` copies the masters into the 16-bit weights after an optimizer step.

Design (why)
------------
* One definition: what is allocated follows spec/precision.py, which the cost model prices from
  (``Precision.element_bytes`` the weight dtype, ``master_bytes`` whether a master copy exists,
  ``MAIN_GRAD_BYTES`` the gradient buffers); the import-time checks below keep the torch dtypes
  and those byte counts from drifting apart, and tests/cost_model/test_state_bytes.py counts the
  live tensors of every rank against the cost model's figure.
* Megatron-core's ``Float16OptimizerWithFloat16Params`` is this scheme (fp32 ``main_param`` per
  16-bit parameter whose ``.grad`` is the ``main_grad``, torch AdamW on the fp32 tensors,
  ``_copy_main_params_to_model_params`` after the step). It is not used itself for the reason
  runtime/trainer.py gives for ``MegatronOptimizer`` (its norm and clipping assume one
  model-parallel group); the masters are plain fp32 tensors and the optimizer torch's AdamW.
* The masters start as fp32 copies of the 16-bit initial weights (as megatron's do), so a
  heterogeneous plan and the single-process reference start from the same bits.
"""

from __future__ import annotations

import torch

from megatron_autohet.spec.precision import MAIN_GRAD_BYTES, PRECISIONS, Precision

_PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAIN_GRAD_DTYPE = torch.float32
MASTER_DTYPE = torch.float32
# megatron-core's name of the fp32 master copy of a 16-bit parameter (optimizer/optimizer.py):
# the optimizer-state key checkpoints save it under
MASTER_KEY = "fp32_param"

# What the cost model charges is what is allocated (module doc).
assert MAIN_GRAD_DTYPE.itemsize == MAIN_GRAD_BYTES
for _p in PRECISIONS.values():
    assert _PARAM_DTYPES[_p.name].itemsize == _p.element_bytes, _p
    assert _p.master_bytes in (0, MASTER_DTYPE.itemsize), _p


def param_dtype(precision: Precision) -> torch.dtype:
    return _PARAM_DTYPES[precision.name]


class MasterWeights:
    """fp32 master copies of 16-bit parameters (module doc); ``named_params``: (local name,
    parameter with ``main_grad``) of every trainable parameter."""

    def __init__(self, named_params, precision: Precision):
        self.precision = precision
        self.by_name: dict[str, torch.Tensor] = {}
        self._params: list[torch.Tensor] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []   # (16-bit param, master)
        for name, param in named_params:
            if precision.master_bytes:
                master = param.detach().to(MASTER_DTYPE, copy=True)
                self._copies.append((param, master))
            else:
                master = param
            self._params.append(param)
            self.by_name[name] = master
        self.use_main_grads()

    def use_main_grads(self) -> None:
        for param, master in zip(self._params, self.by_name.values()):
            master.grad = param.main_grad

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self.by_name.values())

    @torch.no_grad()
    def copy_weights(self) -> None:
        """The masters from the 16-bit weights, as when constructed (after the weights were
        initialised late: runtime/trainer.py ``initialize_weights``)."""
        if self._copies:
            params, masters = zip(*self._copies)
            torch._foreach_copy_(list(masters), list(params))

    @torch.no_grad()
    def write_back(self) -> None:
        """The 16-bit weights from the masters (after an optimizer step or a checkpoint load)."""
        if self._copies:
            params, masters = zip(*self._copies)
            torch._foreach_copy_(list(params), list(masters))
