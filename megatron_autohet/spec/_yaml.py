"""Small helpers shared by the spec loaders: read a YAML mapping, pull typed fields out of it.

Each helper raises :class:`ConfigError` naming the file and the dotted field path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from megatron_autohet.errors import ConfigError

_MISSING = object()


def read_yaml_mapping(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(path, "<file>", "file not found", "a path to an existing YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(path, "<file>", f"not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(path, "<top level>", f"expected a mapping, got {type(data).__name__}")
    return data


def check_keys(data: dict, allowed: set[str], file, where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        field = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(file, field, "unknown field", ", ".join(sorted(allowed)))


def get_field(data: dict, key: str, kind: type | tuple, file, where: str = "",
              default: Any = _MISSING, positive: bool = False,
              min_value: float | None = None) -> Any:
    """Return ``data[key]`` checked against ``kind``; a missing key returns ``default`` or
    raises."""
    field = f"{where}.{key}" if where else key
    if key not in data or data[key] is None:
        if default is _MISSING:
            raise ConfigError(file, field, "missing", _describe(kind))
        return default
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # YAML ints are acceptable where floats are expected; bools are never numbers.
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(file, field, f"got {value!r}", _describe(kind))
    if not isinstance(value, kinds):
        raise ConfigError(file, field, f"got {value!r} ({type(value).__name__})", _describe(kind))
    if isinstance(value, float) and not math.isfinite(value):
        # YAML's .nan/.inf and JSON's NaN/Infinity parse as floats and pass every comparison
        # below (NaN) or make every time and memory figure meaningless (infinity).
        raise ConfigError(file, field, f"got {value!r}", "a finite number")
    if positive and value <= 0:
        raise ConfigError(file, field, f"got {value!r}", "a number > 0")
    if min_value is not None and value < min_value:
        raise ConfigError(file, field, f"got {value!r}", f"a number >= {min_value}")
    return value


def _describe(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false",
             list: "a list", dict: "a mapping"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)
