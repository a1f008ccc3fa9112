"""Run megatron-core on a CPU-only torch build with gloo, without editing installed files.

Public API
----------
``cpu_mode_required() -> bool``
    True when this process has no usable CUDA device (then the runtime must enable CPU mode).
``enable_cpu_mode() -> None``
    Idempotent. Installs the process-wide shims (below) and enters the device-mapping
    ``TorchFunctionMode`` in the calling thread.
``cpu_mode_enabled() -> bool``
    Whether :func:`enable_cpu_mode` has run in this process.
``cpu_mode_thread()``
    Context manager for code running in another thread (a background checkpoint writer, a
    communication thread...): enters the device-mapping mode there if CPU mode is enabled and the
    thread does not have it yet; a no-op otherwise. Torch function modes are thread-local, so a
    thread that touches megatron code must use it.

Design (why it looks like this)
-------------------------------
megatron-core (0.16 to 0.19) assumes a CUDA device in these ways:

1. *Device arguments*: ``torch.empty(..., device=torch.cuda.current_device())``,
   ``torch.zeros(..., device="cuda")``, ``tensor.cuda()``, ``tensor.to("cuda")``. Many of these are
   literals that no ``torch.cuda.*`` patch can reach (in the schedules, the optimizer, grad
   clipping, the language module, ...). A ``torch.overrides.TorchFunctionMode`` sees
   every torch call with its arguments, so :class:`_CudaAsCpuMode` rewrites any CUDA device (string,
   ``torch.device``, or a bare int, which torch reads as ``cuda:N``) to ``cpu`` and turns
   ``Tensor.cuda()`` into the identity. One interception point covers all sites, including ones
   added by future megatron releases. It also answers ``Tensor.type()`` with the CUDA type name
   (``torch.cuda.FloatTensor``) because the optimizer and grad clipping assert on it; the CPU
   tensor then reports the type megatron expects for a device tensor, and
   ``Tensor.type("torch.cuda.X")`` maps back to the CPU type so a round trip stays on the CPU.
2. *``torch.cuda`` functions* that fail on a CPU-only build: ``current_device`` (returns
   ``torch.device("cpu")``: the autograd engine runs custom ``Function.backward`` - megatron's
   sequence-parallel gathers - outside the torch function mode, so this site must be CPU without
   the mode's help), ``synchronize`` (no-op: CPU ops are synchronous), and the RNG
   functions (``manual_seed``/``get_rng_state``/``set_rng_state``), which act on the CPU default
   generator: in CPU mode the CPU generator *is* the device generator; ``current_stream``
   (torch's CPU stream, whose waits are no-ops: megatron-core 0.19's DDP takes it before every
   gradient all-reduce).
3. *Autograd*: custom ``torch.autograd.Function`` backward methods run with an empty torch
   function mode stack, so the mode is also entered around ``BackwardCFunction.apply``, the
   engine's entry into every Python backward (megatron's TP/SP communication ops, activation
   recomputation re-running the forward).
4. *The CUDA RNG tracker* (tensor_parallel/random.py): its private ``_get_cuda_rng_state`` /
   ``_set_cuda_rng_state`` are replaced by CPU versions, and the tracker class is replaced by
   :class:`CpuRNGStatesTracker`, a subclass whose ``fork`` swaps the CPU generator state (the stock
   ``fork`` warns whenever the CPU state changes inside a fork, which in CPU mode is every dropout).
   Activation checkpointing's RNG save/restore goes through the same two private functions.

Not covered: code that formats ``current_device()`` into ``"cuda:N"`` or ``torch.device("cuda",
N)`` (megatron-FSDP, the inference engines); the training path of GPTModel, the schedules, DDP
and the optimizer does not. ``torch.cuda.is_available()`` keeps answering False on purpose: megatron
code that branches on it (timers, memory reports) takes its CPU path. Nothing here is a TE/Apex
shim: the stage model uses the local (non-TE) layer spec on CPU. The torch-norm refusal of
``sequence_parallel`` is not a CPU issue (it also hits GPUs without Apex/TE) and is handled in
``runtime/stage_model.py``.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

logger = logging.getLogger(__name__)

_enabled = False
_install_lock = threading.Lock()
_thread_state = threading.local()     # .mode: the _CudaAsCpuMode entered in this thread


def cpu_mode_required() -> bool:
    """No usable CUDA device in this process: megatron-core can only run here in CPU mode."""
    return not torch.cuda.is_available() or torch.cuda.device_count() == 0


def cpu_mode_enabled() -> bool:
    return _enabled


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True                               # torch reads a bare int as cuda:<int>
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _cpu_type_name(name: str) -> str:
    return name.replace("torch.cuda.", "torch.", 1) if isinstance(name, str) else name


class _CudaAsCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to CPU (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Hot path (every torch call): no copies unless something must change.
        if kwargs is None:
            kwargs = {}
        elif "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func in _SPECIAL_METHODS:
            return _SPECIAL_METHODS[func](func, args, kwargs)
        return func(*args, **kwargs)


def _tensor_cuda(func, args, kwargs):
    return args[0]


def _tensor_to(func, args, kwargs):
    if len(args) > 1 and _is_cuda_device(args[1]):
        args = (args[0], "cpu", *args[2:])
    return func(*args, **kwargs)


def _tensor_type(func, args, kwargs):
    if len(args) == 1 and not kwargs:
        name = func(args[0])
        if args[0].device.type == "cpu" and not name.startswith("torch.cuda."):
            return name.replace("torch.", "torch.cuda.", 1)
        return name
    if len(args) > 1:
        args = (args[0], _cpu_type_name(args[1]), *args[2:])
    if "dtype" in kwargs:
        kwargs = {**kwargs, "dtype": _cpu_type_name(kwargs["dtype"])}
    return func(*args, **kwargs)


_SPECIAL_METHODS = {torch.Tensor.cuda: _tensor_cuda, torch.Tensor.to: _tensor_to,
                    torch.Tensor.type: _tensor_type}


class _CpuRNGStatesTrackerMixin:
    """``fork`` over the CPU default generator (the device generator in CPU mode)."""

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        outer_name = self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(f"current rng state {self._current_state_name} is not the "
                                f"forked state {name}")
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name


def _install_rng_tracker() -> None:
    # megatron-core: on first use, not with this module
    from megatron.core.tensor_parallel import random as mp_random

    stock = mp_random.CudaRNGStatesTracker
    if issubclass(stock, _CpuRNGStatesTrackerMixin):
        return
    tracker_class = type("CpuRNGStatesTracker", (_CpuRNGStatesTrackerMixin, stock), {
        "__doc__": "megatron's CudaRNGStatesTracker over the CPU generator (CPU mode)."})
    mp_random.CudaRNGStatesTracker = tracker_class       # initialize_rng_tracker reads this name
    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: \
        torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: \
        torch.set_rng_state(new_state)
    if mp_random._CUDA_RNG_STATE_TRACKER is not None and not isinstance(
            mp_random._CUDA_RNG_STATE_TRACKER, tracker_class):
        mp_random.initialize_rng_tracker(force_reset=True)


def _install_torch_cuda_shims() -> None:
    # A device object, not 0: the autograd engine runs custom Functions' backward (e.g. the
    # sequence-parallel all-gather in tensor_parallel/layers.py) without the torch function
    # mode, so `device=torch.cuda.current_device()` must already mean the CPU there.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    # megatron-core 0.19's DDP waits on the current stream for CUDA-graph replays before every
    # gradient all-reduce; torch's CPU stream has the same wait_event/wait_stream, as no-ops.
    torch.cuda.current_stream = lambda device=None: torch.cpu.current_stream()
    # torch.manual_seed itself calls torch.cuda.manual_seed_all (left alone: a lazy no-op on a
    # CPU build), so the shim seeds the CPU generator directly.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state


def _mode_active() -> bool:
    return any(isinstance(m, _CudaAsCpuMode) for m in _get_current_function_mode_stack())


def _enter_mode_in_this_thread() -> bool:
    """Enter the device-mapping mode here unless already active; True if it was entered now."""
    if _mode_active():
        return False
    mode = _CudaAsCpuMode()
    mode.__enter__()
    _thread_state.mode = mode
    return True


def _install_backward_hook() -> None:
    """Custom autograd Functions' backward runs with an EMPTY torch function mode stack (the
    engine does not carry modes over), which would leave every device literal inside backward -
    and inside activation recomputation, which reruns the forward there - unmapped. The engine
    calls ``BackwardCFunction.apply`` for each of them; entering the mode around it fixes that."""
    stock_apply = BackwardCFunction.apply
    if getattr(stock_apply, "_autohet_cpu_mode", False):
        return

    def apply(self, *args):
        if _mode_active():
            return stock_apply(self, *args)
        with _CudaAsCpuMode():
            return stock_apply(self, *args)

    apply._autohet_cpu_mode = True
    BackwardCFunction.apply = apply


def enable_cpu_mode() -> None:
    """Make megatron-core run on CPU in this process (idempotent; see the module docstring)."""
    global _enabled
    with _install_lock:
        if not _enabled:
            _install_torch_cuda_shims()
            _install_rng_tracker()
            _install_backward_hook()
            _enabled = True
            logger.info("> autohet CPU mode: megatron-core CUDA devices mapped to CPU (gloo)")
    _enter_mode_in_this_thread()


@contextlib.contextmanager
def cpu_mode_thread():
    """Enter the device-mapping mode in the current (non-main) thread for the duration."""
    if not _enabled:
        yield
        return
    entered = _enter_mode_in_this_thread()
    try:
        yield
    finally:
        if entered:
            _thread_state.mode.__exit__(None, None, None)
            _thread_state.mode = None
