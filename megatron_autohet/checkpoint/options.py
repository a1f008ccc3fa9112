"""The checkpoint flags of a job, shared by ``autohet train`` and the Megatron-LM path (no torch).

Megatron-LM's names where Megatron has the concept, ``--autohet-*`` for what it does not:

``--save DIR``                    Megatron's checkpoint directory, one for the whole job (a shared
                                  filesystem): ``DIR/iter_0000004/`` is a torch_dist checkpoint
                                  stock Megatron-LM reads, ``DIR/latest_checkpointed_iteration.txt``
                                  names the newest.
``--autohet-local-ckpt-dir DIR``  node-local tier: each node writes the state its ranks hold under
                                  its own ``DIR`` (a local disk; ``{node}`` in the path is replaced
                                  by the plan's node name, so emulated nodes on one machine keep
                                  separate directories). When given, steps are written here and
                                  ``--save`` is not written directly.
``--save-interval N``             save every N iterations (and at the end of training).
``--load DIR``                    resume from the newest complete step found in ``DIR`` and the
                                  local tier; nothing there: start from scratch, as Megatron does.
``--autohet-keep-ckpts K``        committed steps kept per directory (default 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_autohet.errors import ConfigError

DEFAULT_KEEP = 2


@dataclass(frozen=True)
class CheckpointOptions:
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    local_dir: str | None = None
    keep: int = DEFAULT_KEEP

    @property
    def saving(self) -> bool:
        return self.save is not None or self.local_dir is not None

    def validate(self, source: str = "<command line>") -> "CheckpointOptions":
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError(source, "--save-interval", f"got {self.save_interval}",
                              "a number of iterations > 0")
        if self.save_interval is not None and not self.saving:
            raise ConfigError(source, "--save-interval", "given without a place to save",
                              "--save DIR and/or --autohet-local-ckpt-dir DIR")
        if self.saving and self.save_interval is None:
            raise ConfigError(source, "--save-interval", "missing",
                              "how often to save (iterations) when --save or "
                              "--autohet-local-ckpt-dir is given")
        if self.keep < 1:
            raise ConfigError(source, "--autohet-keep-ckpts", f"got {self.keep}",
                              "a number of committed steps >= 1")
        return self
