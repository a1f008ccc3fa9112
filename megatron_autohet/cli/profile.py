"""`autohet profile`: measure per-layer costs on this machine, optionally fill in the rest.

Typical use: profile on one node of each GPU type you own (``--tp 1 2 4 8``), and pass
``--cluster`` so GPU types you could not measure get analytic estimates, calibrated by how far
the estimates missed on the measured types; the planner then works from the merged file, in
which every entry says whether it was measured, calibrated or estimated.
"""

from __future__ import annotations

import logging

from megatron_autohet.cli._common import (FUSION_FLAGS, check_activation_fusion_flag,
                                          check_output_path, positive, requested_fusions)
from megatron_autohet.cli._table import format_table
from megatron_autohet.errors import ConfigError
from megatron_autohet.profiling.estimate import achieved_efficiency, estimate_profile
from megatron_autohet.profiling.measure import (catalog_name_for_device, local_accelerator,
                                                measure_profile)
from megatron_autohet.profiling.profile import SOURCES, Profile
from megatron_autohet.spec import load_cluster, load_gpu_catalog, load_model
from megatron_autohet.spec.gpus import set_achieved_efficiency

DEFAULT_WARMUP = 2
DEFAULT_ITERS = 5


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "profile", help="measure layer/embedding/output costs on the local device",
        description="Measure forward/backward time and activation memory of one megatron-core "
                    "TransformerLayer, the embedding and the output layer + loss on this "
                    "machine (GPU if present, else CPU), for each TP degree, micro-batch size and "
                    "sequence length asked for. TP degree t runs t processes (NCCL on t GPUs, "
                    "gloo on a CPU). With --cluster, GPU types of that cluster that were not "
                    "measured here are filled with analytic estimates from the GPU catalog.")
    p.add_argument("--model", required=True, metavar="M.yaml", help="model file (configs/models/)")
    p.add_argument("--tp", type=int, nargs="+", default=[1], metavar="T",
                   help="TP degrees to measure; each needs that many local GPUs (or processes on "
                        "a CPU) (default: 1)")
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=[1], metavar="B",
                   help="micro-batch sizes to measure (default: 1)")
    p.add_argument("--seq-length", type=int, nargs="+", default=None, metavar="S",
                   help="sequence lengths to measure (default: the model's seq_length)")
    p.add_argument("--as-gpu", default=None, metavar="NAME",
                   help="GPU type the entries are recorded as, a key of the GPU catalog (default: "
                        "the catalog type matching the local GPU; 'CPU' on a CPU-only machine)")
    p.add_argument("--cluster", default=None, metavar="C.yaml",
                   help="also estimate every GPU type of this cluster that was not measured here "
                        "(default: measured entries only)")
    p.add_argument("--gpu-catalog", default=None, metavar="G.yaml",
                   help="GPU catalog (default: the bundled configs/gpus.yaml)")
    p.add_argument("--update-catalog", default=None, metavar="G.yaml",
                   help="set the measured GPU type's achieved_efficiency (measured / analytic "
                        "speed, configs/gpus.yaml) in this catalog file, created as a copy of "
                        "--gpu-catalog if it does not exist; plan with it by passing it as "
                        "--gpu-catalog (needs a GPU measurement; default: only printed)")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help=f"untimed iterations before timing each part (default: {DEFAULT_WARMUP})")
    p.add_argument("--iters", type=int, default=DEFAULT_ITERS,
                   help=f"timed iterations per part; the mean is kept (default: {DEFAULT_ITERS})")
    for flags, kwargs in FUSION_FLAGS:      # measure the layer a job with these flags trains
        p.add_argument(*flags, **kwargs)
    p.add_argument("-o", "--output", required=True, metavar="profile.yaml",
                   help="where to write the profile (.json for JSON, else YAML)")
    p.set_defaults(func=run)


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = load_model(args.model)
    check_activation_fusion_flag(args, model)
    catalog = load_gpu_catalog(args.gpu_catalog)
    cluster = load_cluster(args.cluster, catalog) if args.cluster else None
    for flag, values in (("--micro-batch-size", args.micro_batch_size),
                         ("--seq-length", args.seq_length or [])):
        for v in values:
            positive(v, flag)
    seq_lengths = args.seq_length or [model.seq_length]
    for seq in seq_lengths:
        model.check_seq_length(seq, "<command line>", "--seq-length")
    check_output_path(args.output, "--output")
    check_output_path(args.update_catalog, "--update-catalog")
    accelerator = local_accelerator()
    gpu = _device_type(args.as_gpu, catalog, accelerator)
    if args.update_catalog is not None and (accelerator is None or gpu not in catalog):
        # A CPU's fp32 timings recorded as a GPU type say nothing of that GPU's bf16 speed.
        raise ConfigError("<command line>", "--update-catalog", f"measuring {gpu} on "
                          f"{'a CPU' if accelerator is None else accelerator[0]}",
                          "a measurement on a GPU of a catalog type")

    profile = measure_profile(model, args.tp, args.micro_batch_size, seq_lengths, gpu,
                              warmup=args.warmup, iters=args.iters,
                              jit_fusions=requested_fusions(args))
    if cluster is not None:
        estimated = Profile(model.name, attention=profile.attention)
        for mbs in args.micro_batch_size:
            for seq in seq_lengths:
                estimated = estimate_profile(model, cluster, mbs, seq, args.tp,
                                             profile.attention).merged_over(estimated)
        profile = profile.calibrated_over(estimated)
    if accelerator is not None:
        for name, value in achieved_efficiency(profile, model, catalog).items():
            print(f"> {name}: the measured parts ran at {value:.3f} of the analytic "
                  f"estimate's speed (achieved_efficiency; the catalog has "
                  f"{catalog[name].achieved_efficiency:g})")
            if args.update_catalog is not None:
                set_achieved_efficiency(args.update_catalog, name, value, args.gpu_catalog)
                print(f"> set {name}'s achieved_efficiency to {value:.3g} in "
                      f"{args.update_catalog}")
    profile.save(args.output)
    print(format_profile(profile))
    sources = [e.layer.source for e in profile.entries.values()]
    print(f"> wrote {args.output}: {len(profile.entries)} entries ("
          + ", ".join(f"{sources.count(s)} {s}" for s in SOURCES if s in sources) + ")")
    return 0


def _device_type(as_gpu, catalog, accelerator) -> str:
    """The GPU type entries are recorded as (see --as-gpu)."""
    if as_gpu is not None:
        if as_gpu not in catalog and as_gpu != "CPU":
            raise ConfigError("<command line>", "--as-gpu", f"unknown GPU type {as_gpu!r}",
                              ", ".join(sorted(catalog)) + " (or add it with --gpu-catalog)")
        return as_gpu
    if accelerator is None:
        return "CPU"
    name, memory_gib, _ = accelerator
    found = catalog_name_for_device(name, memory_gib, catalog)
    if found is None:
        raise ConfigError("<command line>", "--as-gpu", f"the local GPU {name!r} matches no GPU "
                          f"catalog type; name it", ", ".join(sorted(catalog)))
    return found


def format_profile(profile) -> str:
    """A table: one row per entry, times in ms, activation memory in MiB."""
    header = ("GPU", "TP", "MBS", "seq", "layer fwd", "layer bwd", "layer act MiB",
              "emb fwd+bwd", "out fwd+bwd", "source")
    rows = []
    for e in sorted(profile.entries.values(), key=lambda e: e.key):
        rows.append((e.gpu, str(e.tp), str(e.micro_batch_size), str(e.seq_length),
                     _ms(e.layer.forward_s), _ms(e.layer.backward_s),
                     f"{e.layer.activation_bytes / 2**20:.3g}",
                     _ms(e.embedding.forward_s + e.embedding.backward_s),
                     _ms(e.output.forward_s + e.output.backward_s), e.layer.source))
    return format_table(header, rows) + "\n(times in ms per micro-batch, per GPU of the TP group)"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"
