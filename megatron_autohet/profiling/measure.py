"""Measure one transformer layer, the embedding and the output layer on the local device.

What is measured is megatron-core's own code, built as the runtime builds it for training:
the config comes from ``runtime.stage_model.transformer_config`` (norm, biases, activation,
fusions, dropout and precision as trained: bf16 on a GPU, fp32 on a CPU, spec/precision.py's
``default_precision``) and the layer spec and final norm from ``stage_model.stage_layer_spec``
(Transformer Engine's when it imports and a GPU is present, else megatron's local layer with
torch SDPA as core attention); the profile records which attention that is
(``Profile.attention``, runtime/attention.py ``attention_kind``). Backward adds every gradient into
an fp32 main gradient through the runtime's own hook (runtime/grad_sync.py ``attach_main_grads``),
so a measured backward pays what a trained one does. The parts:

* ``layer``: one ``TransformerLayer`` of that spec;
* ``embedding``: ``LanguageModelEmbedding`` (a ``VocabParallelEmbedding``, plus learned positions
  unless the model uses RoPE), over ``ModelSpec.padded_vocab_size``;
* ``output``: the final norm, the vocab-parallel output projection and
  ``vocab_parallel_cross_entropy`` (what the last pipeline stage runs).

Each is timed forward and backward for ``warmup`` untimed then ``iters`` timed micro-batches; the
mean is kept: an iteration's time is the sum of its ops', so throughput follows the mean, and a
median drops the slower occurrences that training pays for too (on the emulated cluster, where
a CPU quota throttles some runs of a millisecond op and not others, the median put a whole
model's compute 30-34% below what training measured, the mean within 7%). On a GPU, times come
from CUDA events and activation memory from the allocator
(``torch.cuda.memory_allocated`` after the forward pass, less before it and less the output). On
a CPU, times come from ``time.perf_counter`` and activation memory is counted
from the tensors autograd really saves for backward (``torch.autograd.graph.saved_tensors_hooks``,
each storage counted once, parameters excluded). ``activation_bytes_recompute`` is measured the
same way with the module wrapped in megatron-core's ``tensor_parallel.checkpoint`` (full
activation recompute keeps only what the checkpoint saves: the input).

Tensor parallelism is real: a TP degree t is measured by t processes (torch.multiprocessing,
NCCL on t local GPUs, gloo on a CPU), each holding its shard and running the TP collectives, and
the slowest rank's time is kept. :func:`measure_profile` measures in child processes, even t = 1,
so the caller's process never gets megatron's global state, the CPU mode's patches or a process
group. :func:`measure_in_process` measures t = 1 in the calling process instead, for a process
that is a job's rank already (torch, megatron-core and the CPU mode in place, no process group:
a GPU a job's plan leaves idle): a child would import them all again, which at a small share of
a CPU takes minutes.
On a 2-core CPU, t > 1 processes share the cores, so CPU times for t > 1 are upper bounds; what
such a profile is for is exercising the planner and the runtime on a laptop, not predicting GPUs.

The device name in the entries matters because the planner looks entries up by GPU type: on a
GPU it is the GPU catalog's name of the local device (``catalog_name_for_device``) unless the user
names one (``as_gpu``); on a CPU it is ``as_gpu`` or ``"CPU"``.
"""

from __future__ import annotations

import logging
import os
import queue as queue_module
import re
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, replace

from tqdm import tqdm

from megatron_autohet.errors import ConfigError
from megatron_autohet.known_warnings import ignore_known_warnings
from megatron_autohet.profiling.profile import PARTS, OpCost, Profile, entry_from_dict
from megatron_autohet.system.ports import free_port
from megatron_autohet.spec.gpus import GPUType
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import default_precision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeasureRequest:
    """Everything a child process needs; plain data so it pickles into spawned processes."""

    model: ModelSpec
    tp: int
    micro_batch_sizes: tuple[int, ...]
    seq_lengths: tuple[int, ...]
    gpu: str
    warmup: int
    iters: int
    master_port: int
    # the fusions requested (runtime/fusions.py's TransformerConfig fields); None: Megatron-LM's
    # default, all of them
    jit_fusions: dict[str, bool] | None = None


def catalog_name_for_device(device_name: str, memory_gib: float,
                            catalog: dict[str, GPUType]) -> str | None:
    """The catalog key of a device such as 'NVIDIA A100-SXM4-80GB' (-> 'A100-80GB'), or None.

    A key matches when its name tokens other than a memory size ('80GB') appear consecutively in
    the device name's tokens ('H20' does not match 'H200'); among matches the one whose memory is
    closest to the device's wins (A100-40GB vs A100-80GB).
    """
    device_tokens = [t.upper() for t in re.split(r"[^A-Za-z0-9]+", device_name) if t]
    matches = []
    for key, gpu in catalog.items():
        key_tokens = [t.upper() for t in re.split(r"[^A-Za-z0-9]+", key)
                      if t and not re.fullmatch(r"\d+GB", t, re.IGNORECASE)]
        n = len(key_tokens)
        if n and any(device_tokens[i:i + n] == key_tokens
                     for i in range(len(device_tokens) - n + 1)):
            matches.append((abs(gpu.memory_gib - memory_gib), key))
    return min(matches)[1] if matches else None


def local_accelerator() -> tuple[str, float, int] | None:
    """(device name, memory GiB, device count) of the local CUDA GPUs, or None on a CPU."""
    # torch: in the measuring processes only
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / 2**30, torch.cuda.device_count()


def measure_profile(model: ModelSpec, tp_degrees: list[int], micro_batch_sizes: list[int],
                    seq_lengths: list[int], gpu: str, *, warmup: int = 2, iters: int = 5,
                    progress: bool = True, jit_fusions: dict[str, bool] | None = None) -> Profile:
    """Measure every (TP degree, micro-batch size, seq length) on this machine; ``gpu`` names it.
    ``jit_fusions``: the fusions a job would request (runtime/fusions.py; default: Megatron-LM's,
    all of them), measured where this machine runs them.

    Raises ConfigError for a TP degree the model cannot be split by, or more TP ranks than GPUs.
    """
    # torch: in the measuring processes only
    import torch.multiprocessing as mp

    accelerator = local_accelerator()
    for tp in tp_degrees:
        model.check_tp_degree(tp, "<command line>", "--tp")
        if accelerator is not None and tp > accelerator[2]:
            raise ConfigError("<command line>", "--tp", f"TP degree {tp} needs {tp} GPUs, this "
                              f"machine has {accelerator[2]}",
                              f"TP degrees up to {accelerator[2]}")
    if warmup < 0:
        raise ConfigError("<command line>", "--warmup", f"got {warmup}", "a number >= 0")
    if iters < 1:
        raise ConfigError("<command line>", "--iters", f"got {iters}", "a number >= 1")

    logger.info("> measuring %s as %s on %s: TP %s, micro-batch sizes %s, seq lengths %s, "
                "%d warm-up + %d timed iterations each", model.name, gpu,
                accelerator[0] if accelerator else "CPU", tp_degrees, micro_batch_sizes,
                seq_lengths, warmup, iters)
    entries, layers = [], set()
    total = len(tp_degrees) * len(micro_batch_sizes) * len(seq_lengths)
    context = mp.get_context("spawn")
    # (disable None: no bar where stderr is not a terminal, e.g. a job's log file)
    with tqdm(total=total, desc="measuring", unit="entry",
              disable=None if progress else True) as bar:
        for tp in tp_degrees:
            request = MeasureRequest(model, tp, tuple(micro_batch_sizes), tuple(seq_lengths), gpu,
                                     warmup, iters, free_port(), jit_fusions)
            done = context.Queue()
            workers = mp.start_processes(_worker, args=(request, done), nprocs=tp, join=False,
                                         start_method="spawn")
            expected = len(micro_batch_sizes) * len(seq_lengths)
            received = 0
            # Rank 0 reports each finished entry; join() raises if any rank failed.
            while received < expected:
                try:
                    attention, fusions, entry = done.get(timeout=0.5)
                except queue_module.Empty:
                    if workers.join(timeout=0):
                        raise RuntimeError(f"measurement processes for TP={tp} exited after "
                                           f"{received} of {expected} entries") from None
                    continue
                entries.append(entry_from_dict(entry, "<measurement>"))
                layers.add((attention, tuple(sorted(fusions.items()))))
                received += 1
                bar.set_postfix_str(f"tp={tp} mbs={entry['micro_batch_size']} "
                                    f"seq={entry['seq_length']}")
                bar.update(1)
            workers.join()
    return _profile(model, entries, layers, on_gpu=accelerator is not None)


def measure_in_process(model: ModelSpec, micro_batch_size: int, seq_length: int, gpu: str, *,
                       warmup: int = 2, iters: int = 5, rounds: int = 3,
                       jit_fusions: dict[str, bool] | None = None) -> Profile:
    """:func:`measure_profile` at TP 1 and one batch shape, in this process on its current
    device (module docstring), ``rounds`` times: each part's figures are those of its fastest
    round, the least disturbed (what runs beside a measurement, a neighbour's burst of work or
    a throttled period, only ever slows it; on the emulated cluster the rounds of one GPU beside
    its training neighbours spread by 15%). The process must have no default process group:
    one of a single rank is made for each round and destroyed after it, with megatron-core's
    globals; the random state is restored, so what this process trains later draws as before."""
    # torch and megatron-core: a rank's code, imported there already
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_autohet.runtime.cpu_mode import cpu_mode_enabled, enable_cpu_mode

    if dist.is_initialized():
        raise RuntimeError("measure_in_process needs a process without a process group")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    on_gpu = torch.cuda.is_available() and not cpu_mode_enabled()
    if not on_gpu:
        enable_cpu_mode()
    request = MeasureRequest(model, 1, (micro_batch_size,), (seq_length,), gpu, warmup, iters,
                             0, jit_fusions)
    measured, layers = [], set()

    def report(attention, fusions, entry):
        measured.append(entry_from_dict(entry, "<measurement>"))
        layers.add((attention, tuple(sorted(fusions.items()))))

    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if on_gpu else []):
        for _ in range(rounds):
            # megatron-core's globals a plan this process trained in left
            # (initialize_model_parallel refuses to make groups over them; the next plan
            # installs its own)
            parallel_state.destroy_model_parallel()
            _measure_group(request, on_gpu, 0, report, store=dist.HashStore())
    fastest = replace(measured[0], **{
        part: min((getattr(entry, part) for entry in measured),
                  key=lambda cost: cost.forward_s + cost.backward_s) for part in PARTS})
    return _profile(model, [fastest], layers, on_gpu)


def _profile(model: ModelSpec, entries: list, layers: set, on_gpu: bool) -> Profile:
    # one layer spec (runtime/stage_model.py) and one torch.compile per machine
    ((attention, fusions),) = layers
    # in the precision the runtime trains in on this device, as the measurement ran
    profile = Profile(model.name, precision=default_precision(on_gpu=on_gpu),
                      attention=attention, fusions=dict(fusions))
    for entry in entries:
        profile.add(entry)
    return profile


# ---- child process ---------------------------------------------------------------------------

def _worker(rank: int, request: MeasureRequest, done) -> None:
    # As Megatron-LM's launch scripts do: one CUDA work queue, so TP communication overlaps
    # compute the way it will in training (read when CUDA initialises, so set first).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request.master_port),
                      CUDA_DEVICE_MAX_CONNECTIONS="1")
    # The measuring processes are a group of their own: spawned from a torchrun worker
    # (`autohet profile` under torchrun) they would otherwise meet on the torchrun agent's
    # store, every measurement's rank 0 under one key, and wait there for ever.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    # A spawned process: megatron-core's known-benign warnings are filtered here again, before
    # it is imported (rank 0 prints which layer spec was measured instead).
    ignore_known_warnings()
    # torch: in the measuring processes only
    import torch

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(rank)
    else:
        # torch: in the measuring processes only
        from megatron_autohet.runtime.cpu_mode import enable_cpu_mode
        enable_cpu_mode()
    _measure_group(request, on_gpu, rank, lambda *reported: done.put(reported))


def _measure_group(request: MeasureRequest, on_gpu: bool, rank: int, report,
                   store=None) -> None:
    """On each rank of a default process group of ``request.tp`` ranks, made here (on
    ``store``; None: the environment's MASTER_ADDR and MASTER_PORT): every entry measured, each
    handed to ``report(attention, fusions, entry)`` on rank 0; the group and megatron's globals
    destroyed after, also when a measurement raised."""
    # torch, megatron-core: in the measuring processes only
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=request.tp,
                            store=store)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=request.tp)
        model_parallel_cuda_manual_seed(1234)
        bench = _Bench(request, on_gpu)
        if rank == 0:
            print(f"> TP={request.tp}: layer {bench.layer_kind}, {bench.attention} attention, "
                  f"{bench.dtype}, {'GPU' if on_gpu else 'CPU'}", flush=True)
        for mbs in request.micro_batch_sizes:
            for seq in request.seq_lengths:
                entry = bench.measure_entry(mbs, seq)
                if rank == 0:
                    report(bench.attention, bench.fusions.config_fields(), entry)
    finally:
        # Megatron's groups first (they live in the default group), also when a measurement raised.
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class _Bench:
    """Builds the three parts once per TP degree and times them for each batch shape."""

    def __init__(self, request: MeasureRequest, on_gpu: bool):
        # torch, megatron-core: in the measuring processes only
        import torch
        from megatron.core.transformer.spec_utils import build_module

        from megatron_autohet.runtime.attention import attention_kind
        from megatron_autohet.runtime.fusions import MEGATRON_LM_DEFAULTS, local_jit_fusions
        from megatron_autohet.runtime.grad_sync import attach_main_grads
        from megatron_autohet.runtime.mixed_precision import MAIN_GRAD_DTYPE, param_dtype
        from megatron_autohet.runtime.stage_model import (model_device, stage_layer_spec,
                                                          transformer_config)

        self.request, self.on_gpu = request, on_gpu
        self.device = model_device()
        # The precision the runtime trains in on this device (bf16 on a GPU, fp32 on CPU), and
        # the runtime's own config and layer spec (norm, biases, activation, fusions, attention,
        # dropout, init), so the measured layer is the trained one.
        precision = default_precision(on_gpu)
        self.dtype = param_dtype(precision)
        # megatron-core's fused kernels where this process can run them, as `autohet train`
        self.fusions = local_jit_fusions(MEGATRON_LM_DEFAULTS if request.jit_fusions is None
                                         else request.jit_fusions)
        self.config = transformer_config(request.model, request.tp, precision=precision,
                                         **self.fusions.config_fields())
        layer_spec, final_norm = stage_layer_spec(self.config)
        self.layer = build_module(layer_spec, config=self.config, layer_number=1).to(self.device)
        core_attention = self.layer.self_attention.core_attention
        self.attention = attention_kind(core_attention)
        self.layer_kind = (f"{type(self.layer.self_attention.linear_qkv).__name__} / "
                           f"{type(core_attention).__name__} / "
                           f"{final_norm.__name__} ({self.config.normalization})"
                           + (f"; {self.fusions.describe()}" if on_gpu else ""))
        # In the model's dtype as the stage model casts it (the learned position embedding is a
        # torch.nn.Embedding megatron builds in fp32).
        self.embedding = self._build_embedding().to(self.device, self.dtype)
        # TransformerBlock's final norm, built as the block builds it.
        self.final_norm = build_module(final_norm, config=self.config,
                                       hidden_size=self.config.hidden_size,
                                       eps=self.config.layernorm_epsilon).to(self.device)
        self.output_layer = self._build_output_layer().to(self.device)
        # Backward adds every gradient into an fp32 main gradient, as training's does (in bf16 a
        # read-add-write of 10 bytes per parameter per micro-batch, a few percent of a layer's
        # backward on a GPU): the runtime's own mechanism, on buffers never zeroed (only the
        # time is kept).
        params = [p for module in (self.layer, self.embedding, self.final_norm,
                                   self.output_layer)
                  for p in module.parameters() if p.requires_grad]
        attach_main_grads(params, [torch.zeros_like(p, dtype=MAIN_GRAD_DTYPE) for p in params])

    # -- building megatron-core modules --------------------------------------------------------
    def _build_embedding(self):
        # megatron-core: in the measuring processes only
        from megatron.core.models.common.embeddings.language_model_embedding import \
            LanguageModelEmbedding

        model = self.request.model
        return LanguageModelEmbedding(
            self.config, vocab_size=model.padded_vocab_size([self.request.tp]),
            # Sized like GPTModel's: the model's positions, or more if a longer seq is measured.
            max_sequence_length=max(model.seq_length, *self.request.seq_lengths),
            position_embedding_type=model.position_embedding_type)

    def _build_output_layer(self):
        # megatron-core: in the measuring processes only
        from megatron.core import tensor_parallel

        # GPTModel's output layer: column-parallel over the vocabulary, logits stay split.
        # With tied embeddings the last stage still holds (a synced copy of) this matrix.
        return tensor_parallel.ColumnParallelLinear(
            self.config.hidden_size, self.request.model.padded_vocab_size([self.request.tp]),
            config=self.config, init_method=self.config.init_method, bias=False,
            skip_bias_add=False, gather_output=False)

    def _rotary(self, seq: int):
        if self.request.model.position_embedding_type != "rope":
            return None
        # megatron-core: in the measuring processes only
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        rope = RotaryEmbedding(kv_channels=self.config.kv_channels, rotary_percent=1.0)
        return rope(seq).to(self.device)

    # -- one entry -----------------------------------------------------------------------------
    def measure_entry(self, mbs: int, seq: int) -> dict:
        # torch: in the measuring processes only
        import torch

        model, h = self.request.model, self.config.hidden_size
        rotary = self._rotary(seq)

        def hidden():
            return torch.randn(seq, mbs, h, device=self.device, dtype=self.dtype,
                               requires_grad=True)

        tokens = torch.randint(0, model.vocab_size, (mbs, seq), device=self.device)
        positions = torch.arange(seq, device=self.device).unsqueeze(0).expand(mbs, seq)
        labels = torch.randint(0, model.vocab_size, (seq, mbs), device=self.device)

        def run_layer(x):
            out, _ = self.layer(x, attention_mask=None, rotary_pos_emb=rotary)
            return out

        def run_output(x):
            # megatron-core: in the measuring processes only
            from megatron.core import tensor_parallel

            logits, _ = self.output_layer(self.final_norm(x))
            return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean()

        parts = {
            "layer": self._measure(self.layer, lambda: run_layer(hidden()), run_layer, hidden),
            "embedding": self._measure(self.embedding, lambda: self.embedding(tokens, positions),
                                       None, None),
            "output": self._measure((self.final_norm, self.output_layer),
                                    lambda: run_output(hidden()), run_output, hidden),
        }
        return {"gpu": self.request.gpu, "tp": self.request.tp, "micro_batch_size": mbs,
                "seq_length": seq, **{k: asdict(v) for k, v in parts.items()}}

    def _measure(self, modules, forward, recompute_fn, make_input) -> OpCost:
        """Time forward/backward of ``forward()`` and count its activations, with and without
        full recompute (``recompute_fn(x)`` under megatron's checkpoint; None: nothing to
        recompute, the input is token ids)."""
        # torch: in the measuring processes only
        import torch
        import torch.distributed as dist

        modules = modules if isinstance(modules, tuple) else (modules,)
        params = [p for m in modules for p in m.parameters()]
        fwd_times, bwd_times = [], []
        for i in range(self.request.warmup + self.request.iters):
            dist.barrier()
            t0 = self._clock()
            out = forward()
            t1 = self._clock()
            out.backward(torch.ones_like(out) if out.dim() else None)
            t2 = self._clock()
            if i >= self.request.warmup:
                fwd_times.append(self._elapsed(t0, t1))
                bwd_times.append(self._elapsed(t1, t2))
        # The slowest TP rank sets the pace of the group.
        times = torch.tensor([statistics.fmean(fwd_times), statistics.fmean(bwd_times)],
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)

        activation = self._activation_bytes(forward, params)
        if recompute_fn is None:
            recompute = activation
        else:
            # megatron-core: in the measuring processes only
            from megatron.core import tensor_parallel

            recompute = self._activation_bytes(
                lambda: tensor_parallel.checkpoint(recompute_fn, False, make_input()), params)
        return OpCost(forward_s=float(times[0]), backward_s=float(times[1]),
                      activation_bytes=float(activation),
                      activation_bytes_recompute=float(recompute),
                      param_count=sum(p.numel() for p in params), source="measured")

    def _activation_bytes(self, forward, params) -> int:
        """Bytes one micro-batch keeps alive from forward to backward on this rank."""
        # torch: in the measuring processes only
        import torch

        if self.on_gpu:
            # What the allocator still holds after forward, less the output (the caller's: the
            # next layer's input, counted there as that layer's saved input).
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = forward()
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
            del out
            return max(kept, 0)
        # Count what the graph still holds once forward returns: tensors saved inside a scope that
        # ends in forward (megatron's checkpoint runs its function under enable_grad for
        # bias-dropout-add and then drops that graph) are dead by then and are not counted.
        param_storages = {p.untyped_storage().data_ptr() for p in params}
        saved: list[tuple[int, int, weakref.ref]] = []

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in param_storages:
                saved.append((storage.data_ptr(), storage.nbytes(), weakref.ref(t)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        alive = {ptr: nbytes for ptr, nbytes, ref in saved if ref() is not None}
        del out
        return sum(alive.values())

    def _clock(self):
        # torch: in the measuring processes only
        import torch

        if self.on_gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed(self, start, end) -> float:
        if self.on_gpu:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

