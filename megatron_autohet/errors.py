"""The one error type for bad user input, and the value checks both front ends share.

Every message names the file, the field and what is allowed, so a user can fix the input without
reading a traceback. The CLI prints ``str(err)`` and exits with status 2.
"""

from __future__ import annotations

import math
from pathlib import Path


class ConfigError(ValueError):
    """Bad input in a YAML/JSON file (or a CLI value standing in for one)."""

    def __init__(self, file: str | None, field: str, problem: str, allowed: str | None = None):
        self.file = str(file) if file is not None else "<input>"
        self.field = field
        self.problem = problem
        self.allowed = allowed
        message = f"{self.file}: field '{field}': {problem}"
        if allowed:
            message += f" (allowed: {allowed})"
        super().__init__(message)


class JobConfigError(ConfigError):
    """A :class:`ConfigError` that every rank of a running job raises together, from the same
    flags, plan and agreed checkpoint step (a resume that no step can serve, a ``--ckpt-step``
    committed nowhere): the job prints it once and every rank exits with status 2
    (launch.run_worker, megatron/hooks.stop_job), instead of one traceback per rank; an elastic
    job stops for good (elastic/worker.py: a new round would raise it again)."""


def probability(value: float, flag: str) -> None:
    """A dropout probability (``autohet train`` and ``pretrain_gpt.py`` take the same flags):
    torch's dropout takes [0, 1]; 1 would zero every activation."""
    if not 0 <= value < 1:
        raise ConfigError("<command line>", flag, f"got {value}", "a probability in [0, 1)")


def positive(value: float | None, flag: str, source: str = "<command line>") -> None:
    """A count, interval or limit: > 0 and finite (nan and inf are no limit, not a value)."""
    if value is None or 0 < value < math.inf:
        return
    problem = f"got {value}" if math.isfinite(value) else f"got {value}, not a finite number"
    raise ConfigError(source, flag, problem, "a number > 0")


def check_output_path(path: str | None, flag: str) -> None:
    """Before any work: the file ``path`` can be created (its directory exists), so a typo costs
    a second instead of the search, measurement or training it would end."""
    if path is not None and not Path(path).expanduser().absolute().parent.is_dir():
        raise ConfigError("<command line>", flag, f"{path}: directory "
                          f"{Path(path).expanduser().absolute().parent} does not exist",
                          "a file in an existing directory")
