"""The GPU catalog: datasheet figures for each GPU type the planner knows.

``configs/gpus.yaml`` is the bundled catalog; users may pass their own. Figures are datasheet peaks;
the cost model applies efficiency factors, and measured profiles replace estimates altogether.
"""

from __future__ import annotations

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


_FIELDS = {"dense_tflops", "memory_gib", "memory_bandwidth_gbs", "intra_node_bandwidth_gbs",
           "bf16", "notes"}


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
        )
    return catalog
