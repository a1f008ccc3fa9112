"""What the benchmark scripts share (imported from scripts/, the directory they run from)."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_autohet.known_warnings import ignore_known_warnings

# megatron-core's known-benign warnings: the product's own list and filter
# (megatron_autohet/known_warnings.py), for the benchmarks' processes that run no `autohet` main.
silence_known_megatron_warnings = ignore_known_warnings


def write_json(result: dict, path: str) -> None:
    """The benchmark's figures as JSON (bench-out/<name>.json by default)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
