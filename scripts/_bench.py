"""What the benchmark scripts share (imported from scripts/, the directory they run from)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

# megatron-core's warnings that are known and say nothing about a benchmark: Apex / Transformer
# Engine missing (on CPU it falls back to torch) and the deprecation its own TransformerConfig
# default (cuda_graph_scope "full") triggers.
KNOWN_MEGATRON_WARNINGS = (r".*Apex (is|are) not installed", r"full scope is deprecated")


def silence_known_megatron_warnings() -> None:
    """Every rank repeats those warnings (once per module), which buried the tables; only the
    benchmarks' processes drop them, the product keeps them."""
    for message in KNOWN_MEGATRON_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def write_json(result: dict, path: str) -> None:
    """The benchmark's figures as JSON (bench-out/<name>.json by default)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
