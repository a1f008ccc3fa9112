"""The GPU catalog: datasheet figures for each GPU type the planner knows.

``configs/gpus.yaml`` is the bundled catalog; users may pass their own. Figures are datasheet peaks;
the analytic estimates (profiling/estimate.py) apply efficiency factors to them, then divide by
the type's ``achieved_efficiency``: the fraction of that analytic speed a training step was
measured to reach on the type (1: no measurement, the estimate as is). ``autohet profile
--update-catalog`` sets it from a measured profile (:func:`set_achieved_efficiency`); measured
profile entries replace estimates altogether.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megatron_autohet.errors import ConfigError
from megatron_autohet.spec._yaml import check_keys, get_field, read_yaml_mapping

CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "configs"
DEFAULT_CATALOG = CONFIG_DIR / "gpus.yaml"


@dataclass(frozen=True)
class GPUType:
    name: str
    dense_tflops: float              # dense bf16 tensor-core TFLOP/s (fp16 where there is no bf16)
    memory_gib: float                # device memory
    memory_bandwidth_gbs: float      # device memory bandwidth, GB/s
    intra_node_bandwidth_gbs: float  # GPU-to-GPU inside a node, GB/s per direction (NVLink or PCIe)
    bf16: bool = True                # False: the GPU trains in fp16 (V100, T4)
    notes: str = ""
    # Measured / analytic speed of a training step on this type (module doc): the estimates'
    # times are divided by it.
    achieved_efficiency: float = 1.0


_FIELDS = {"dense_tflops", "memory_gib", "memory_bandwidth_gbs", "intra_node_bandwidth_gbs",
           "bf16", "notes", "achieved_efficiency"}


def load_gpu_catalog(path: str | Path | None = None) -> dict[str, GPUType]:
    """Load a catalog file: a mapping ``gpus: {NAME: {dense_tflops: ..., ...}}``."""
    path = Path(path) if path is not None else DEFAULT_CATALOG
    data = read_yaml_mapping(path)
    check_keys(data, {"gpus"}, path, "")
    gpus = get_field(data, "gpus", dict, path)
    if not gpus:
        raise ConfigError(path, "gpus", "empty", "at least one GPU type")
    catalog = {}
    for name, entry in gpus.items():
        where = f"gpus.{name}"
        if not isinstance(entry, dict):
            raise ConfigError(path, where, f"expected a mapping, got {entry!r}")
        check_keys(entry, _FIELDS, path, where)
        catalog[str(name)] = GPUType(
            name=str(name),
            dense_tflops=get_field(entry, "dense_tflops", float, path, where, positive=True),
            memory_gib=get_field(entry, "memory_gib", float, path, where, positive=True),
            memory_bandwidth_gbs=get_field(entry, "memory_bandwidth_gbs", float, path, where,
                                           positive=True),
            intra_node_bandwidth_gbs=get_field(entry, "intra_node_bandwidth_gbs", float, path,
                                               where, positive=True),
            bf16=get_field(entry, "bf16", bool, path, where, default=True),
            notes=get_field(entry, "notes", str, path, where, default=""),
            achieved_efficiency=get_field(entry, "achieved_efficiency", float, path, where,
                                          default=1.0, positive=True),
        )
    return catalog


def set_achieved_efficiency(path: str | Path, gpu: str, value: float,
                            source: str | Path | None = None) -> None:
    """Write ``achieved_efficiency: value`` into the entry of ``gpu`` of the catalog file
    ``path``, created as a copy of ``source`` (default: the bundled catalog) when it does not
    exist. The file is edited as text, so its comments (the catalog documents itself) stay; the
    entry must be in block style (``NAME:`` on its own line, one field per line, as in the
    bundled catalog). The result is loaded back before it replaces the file."""
    path = Path(path)
    text = (path if path.is_file() else Path(source or DEFAULT_CATALOG)).read_text()
    if gpu not in load_gpu_catalog(path if path.is_file() else (source or DEFAULT_CATALOG)):
        raise ConfigError(path, f"gpus.{gpu}", "no such GPU type in the catalog",
                          "a GPU type of the catalog")
    lines = text.splitlines(keepends=True)
    header = re.compile(rf"^(\s+){re.escape(gpu)}:\s*(#.*)?$")
    start = next((i for i, line in enumerate(lines) if header.match(line.rstrip("\n"))), None)
    if start is None:
        raise ConfigError(path, f"gpus.{gpu}", "the entry is not in block style (NAME: on its "
                          "own line)", "one field per line under the GPU's name, as in "
                          "configs/gpus.yaml")
    indent = len(header.match(lines[start].rstrip("\n")).group(1))
    end = start + 1
    while end < len(lines) and (not lines[end].strip()
                                or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    fields = [i for i in range(start + 1, end) if lines[i].strip()
              and not lines[i].lstrip().startswith("#")]
    child = (" " * (len(lines[fields[0]]) - len(lines[fields[0]].lstrip())) if fields
             else " " * (indent + 2))
    new = f"{child}achieved_efficiency: {value:.3g}\n"
    existing = next((i for i in fields
                     if lines[i].lstrip().startswith("achieved_efficiency:")), None)
    if existing is not None:
        lines[existing] = new
    else:
        lines.insert(fields[-1] + 1 if fields else start + 1, new)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines))
    try:
        catalog = load_gpu_catalog(tmp)
    except ConfigError:
        tmp.unlink()
        raise
    assert catalog[gpu].achieved_efficiency == float(f"{value:.3g}")
    tmp.replace(path)
