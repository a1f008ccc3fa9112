"""The checkpoint flags of a job, shared by ``autohet train`` and the Megatron-LM path (no torch).

:class:`CheckpointOptions` holds them, checked by its ``validate``; :func:`tier_flags` is the one
definition of the ``--autohet-*`` flags of the tiers, which both front ends add to their parsers
(cli/train.py, megatron/args.py), and :func:`tier_fields` reads them back; :func:`object_store`
builds the object-store tier they name (S3: boto3 is imported only then);
:func:`check_scheduler_flags` checks the learning-rate schedule flags against a resume.

Megatron-LM's names where Megatron has the concept, ``--autohet-*`` for what it does not:

``--save DIR``                    Megatron's checkpoint directory, one for the whole job (a shared
                                  filesystem): ``DIR/iter_0000004/`` is a torch_dist checkpoint
                                  stock Megatron-LM reads, ``DIR/latest_checkpointed_iteration.txt``
                                  names the newest.
``--autohet-local-ckpt-dir DIR``  node-local tier: each node writes the state its ranks hold under
                                  its own ``DIR`` (a local disk; ``{node}`` in the path is replaced
                                  by the plan's node name, so emulated nodes on one machine keep
                                  separate directories), including copies of chunks whose main
                                  copy is on another node. Instead of ``--save``, not with it.
``--save-interval N``             save every N iterations (and at the end of training).
``--load DIR``                    resume from the newest complete step found in ``DIR`` (``{node}``
                                  expanded as above), the local tier and the S3 tier; none
                                  anywhere: start from scratch, as Megatron does.
``--autohet-keep-ckpts K``        committed steps kept per directory and in S3 (default 2).
``--async-save``                  Megatron's: training stalls only to copy the state to host
                                  memory; files are written (and uploaded) in the background.
                                  A save due while the previous one is still being written is
                                  skipped (one line; the next interval saves), except the last.
``--autohet-max-failed-saves K``  a failed save (its root cause in one line, its traceback in
                                  ``autohet-checkpoint-errors.log`` in the checkpoint directory)
                                  lets training go on, unless it is the K-th in a row (default
                                  2) or the last save of the run: then the job stops, non-zero.
                                  A failed S3 upload of a complete local step is a warning only.
``--autohet-s3-uri s3://B/P``     S3 tier: every step is uploaded in the background (one copy of
                                  each chunk), and recovery reads from it what no disk holds.
``--autohet-s3-endpoint-url URL`` an S3-compatible endpoint (MinIO, Ceph, a test server);
                                  credentials come from boto3's standard chain, never flags.
``--autohet-take-over-ckpt``      take the writer lease of the checkpoint locations from a job
                                  that holds it but is known to be dead (checkpoint/lease.py:
                                  one live writer per directory and S3 prefix; a second job is
                                  refused in one line naming the owner).
``--autohet-resume-without-s3``   a ``--load`` whose S3 tier cannot be reached (after a minute
                                  of attempts) recovers from the disks alone, or trains from
                                  scratch when they hold no step, instead of stopping (one line,
                                  status 2): the newest step may be in S3 only, and a step
                                  committed there is never overwritten (checkpoint/upload.py).

What a resume takes from the step, Megatron-LM's flags and meaning (core_v0.16.1
``load_checkpoint``); each needs ``--load``:

``--exit-on-missing-checkpoint``  no complete step to load: stop (one line, status 2) instead of
                                  training from scratch.
``--ckpt-step N``                 load step N instead of the newest (committed somewhere: a disk
                                  of the job or S3; no fallback to an older one).
``--no-load-optim``               weights only from the optimizer's side: fresh Adam moments and
                                  step, and a fresh learning-rate schedule (Megatron loads the
                                  scheduler with the optimizer); iteration, data position and RNG
                                  states continue.
``--no-load-rng``                 keep this run's RNG states (seeded from ``--seed``).
``--finetune``                    the weights alone: iteration 0 and consumed samples 0, fresh
                                  Adam state and schedule, this run's RNG states.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_autohet.errors import ConfigError

DEFAULT_KEEP = 2
DEFAULT_MAX_FAILED_SAVES = 2


@dataclass(frozen=True)
class CheckpointOptions:
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    local_dir: str | None = None
    keep: int = DEFAULT_KEEP
    async_save: bool = False
    s3_uri: str | None = None
    s3_endpoint_url: str | None = None
    ckpt_step: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    max_failed_saves: int = DEFAULT_MAX_FAILED_SAVES
    exit_on_missing_checkpoint: bool = False
    resume_without_s3: bool = False
    take_over: bool = False
    # The job's name on its writer lease (checkpoint/lease.py), the same for all its processes:
    # set by the launcher that took the lease first; None: the job's rank 0 makes one.
    owner: str | None = None

    @property
    def load_optim(self) -> bool:
        """Adam state and learning-rate schedule come from the step."""
        return not (self.finetune or self.no_load_optim)

    @property
    def load_rng(self) -> bool:
        return not (self.finetune or self.no_load_rng)

    @property
    def saving(self) -> bool:
        return self.save is not None or self.local_dir is not None

    def validate(self, source: str = "<command line>") -> "CheckpointOptions":
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError(source, "--save-interval", f"got {self.save_interval}",
                              "a number of iterations > 0")
        if self.save_interval is not None and not self.saving:
            raise ConfigError(source, "--save-interval", "given without a place to save",
                              "--save DIR or --autohet-local-ckpt-dir DIR")
        if self.saving and self.save_interval is None:
            raise ConfigError(source, "--save-interval", "missing",
                              "how often to save (iterations) when --save or "
                              "--autohet-local-ckpt-dir is given")
        if self.keep < 1:
            raise ConfigError(source, "--autohet-keep-ckpts", f"got {self.keep}",
                              "a number of committed steps >= 1")
        if self.save is not None and self.local_dir is not None:
            raise ConfigError(source, "--save", "given with --autohet-local-ckpt-dir",
                              "one place that every rank writes: --save DIR (shared) or "
                              "--autohet-local-ckpt-dir DIR (node-local; add --autohet-s3-uri "
                              "for a durable copy)")
        if self.async_save and not self.saving:
            raise ConfigError(source, "--async-save", "given without a place to save",
                              "--save DIR or --autohet-local-ckpt-dir DIR")
        if self.s3_uri is not None:
            # boto3: not at `autohet` start-up
            from megatron_autohet.checkpoint.s3_store import parse_s3_uri
            parse_s3_uri(self.s3_uri)
            if not self.saving and self.load is None:
                raise ConfigError(source, "--autohet-s3-uri", "given without saving or loading",
                                  "with --save/--autohet-local-ckpt-dir (upload) and/or --load "
                                  "(recovery)")
        if self.max_failed_saves < 1:
            raise ConfigError(source, "--autohet-max-failed-saves", f"got {self.max_failed_saves}",
                              "a number of consecutive failed saves >= 1")
        for flag, given in (("--ckpt-step", self.ckpt_step is not None),
                            ("--exit-on-missing-checkpoint", self.exit_on_missing_checkpoint),
                            ("--finetune", self.finetune), ("--no-load-optim", self.no_load_optim),
                            ("--no-load-rng", self.no_load_rng)):
            if given and self.load is None:
                raise ConfigError(source, flag, "given without --load",
                                  "with --load DIR (it says what a resume takes from the step)")
        if self.ckpt_step is not None and self.ckpt_step <= 0:
            raise ConfigError(source, "--ckpt-step", f"got {self.ckpt_step}",
                              "the iteration of a saved step (> 0)")
        if self.s3_endpoint_url is not None and self.s3_uri is None:
            raise ConfigError(source, "--autohet-s3-endpoint-url", "given without --autohet-s3-uri",
                              "an endpoint for the S3 tier named by --autohet-s3-uri")
        if self.resume_without_s3 and (self.s3_uri is None or self.load is None):
            raise ConfigError(source, "--autohet-resume-without-s3",
                              "given without " + ("--autohet-s3-uri" if self.s3_uri is None
                                                  else "--load"),
                              "with --load and --autohet-s3-uri (it says what a resume does "
                              "when the S3 tier cannot be reached)")
        if self.take_over and not self.saving:
            raise ConfigError(source, "--autohet-take-over-ckpt", "given without a place to save",
                              "--save DIR or --autohet-local-ckpt-dir DIR (it takes over their "
                              "writer lease)")
        return self

    def save_roots(self, nodes: list[str]) -> list[Path]:
        """The directories a job whose ranks are on ``nodes`` (one entry per rank) saves to,
        one per rank: ``--save`` for all, or ``--autohet-local-ckpt-dir`` with ``{node}``
        replaced by each rank's node name (emulated nodes on one machine need distinct
        directories; without ``{node}``: one path every node has on its own disk)."""
        if self.local_dir is not None:
            return [node_path(self.local_dir, node) for node in nodes]
        if self.save is not None:
            return [Path(self.save) for _ in nodes]
        return []


def node_path(template: str, node: str) -> Path:
    """A checkpoint path of ``node``: ``{node}`` in ``template`` replaced by its name."""
    return Path(template.replace("{node}", node))


def tier_flags(prefix: str = "") -> list[tuple[tuple[str, ...], dict]]:
    """The ``--autohet-*`` flags of the checkpoint tiers as (option strings, ``add_argument``
    keywords) each, every help text after ``prefix`` (Megatron-LM's parser says "With
    --autohet-plan: ", its flags being ignored without it)."""
    return [
        (("--autohet-local-ckpt-dir",), dict(
            default=None, help=prefix + "node-local checkpoint directory, instead of --save "
                                        "(with --save-interval): each node writes what its "
                                        "ranks hold there; '{node}' in the path becomes the "
                                        "plan's node name (emulated nodes on one machine)")),
        (("--autohet-keep-ckpts",), dict(
            type=int, default=DEFAULT_KEEP,
            help=prefix + f"committed checkpoints kept per directory and in S3 (default "
                          f"{DEFAULT_KEEP})")),
        (("--autohet-max-failed-saves",), dict(
            type=int, default=DEFAULT_MAX_FAILED_SAVES,
            help=prefix + "a failed save prints one line with its root cause (the traceback "
                          "goes to autohet-checkpoint-errors.log in the checkpoint directory) "
                          "and training goes on, unless it is the K-th failed save in a row or "
                          "the last save of the run: then the job stops with status 1, saying "
                          "which steps are complete and where. A failed S3 upload of a "
                          f"complete local step is a warning only (default "
                          f"{DEFAULT_MAX_FAILED_SAVES})")),
        (("--autohet-s3-uri",), dict(
            default=None, help=prefix + "S3 tier s3://BUCKET/PREFIX; each checkpoint is "
                                        "uploaded in the background, and recovery downloads "
                                        "from it only what no surviving disk holds "
                                        "(credentials: boto3's standard chain)")),
        (("--autohet-s3-endpoint-url",), dict(
            default=None, help=prefix + "endpoint of the S3-compatible store --autohet-s3-uri "
                                        "names (default: AWS)")),
        (("--autohet-take-over-ckpt",), dict(
            action="store_true",
            help=prefix + "take the writer lease of --save / --autohet-local-ckpt-dir / "
                          "--autohet-s3-uri from the job that holds it, when that job is known "
                          "to be dead (a lease is otherwise free only when its owner's heartbeat "
                          "is over 2 minutes old, or its process is gone on this host)")),
        (("--autohet-resume-without-s3",), dict(
            action="store_true",
            help=prefix + "at --load, when the S3 tier cannot be reached (tried for about a "
                          "minute): recover from the disks alone, or train from scratch when "
                          "they hold no step, instead of stopping with status 2. A step "
                          "committed in S3 is never overwritten by this job's saves")),
    ]


def tier_fields(args) -> dict:
    """The :class:`CheckpointOptions` fields of the :func:`tier_flags` in a parsed namespace."""
    return dict(local_dir=args.autohet_local_ckpt_dir, keep=args.autohet_keep_ckpts,
                max_failed_saves=args.autohet_max_failed_saves, s3_uri=args.autohet_s3_uri,
                s3_endpoint_url=args.autohet_s3_endpoint_url,
                resume_without_s3=args.autohet_resume_without_s3,
                take_over=args.autohet_take_over_ckpt)


def object_store(options: CheckpointOptions, *, flag: str = "--autohet-s3-uri"):
    """The object-store tier ``options`` name (``s3_uri``, ``s3_endpoint_url``), or None: the one
    factory of that tier (checkpoint/sources.py), where another store would be chosen. A URI that
    is not one is a ConfigError naming ``flag``."""
    if options.s3_uri is None:
        return None
    # boto3: only for a job or command with an S3 tier
    from megatron_autohet.checkpoint.s3_store import S3Store, parse_s3_uri

    parse_s3_uri(options.s3_uri, flag)
    return S3Store(options.s3_uri, endpoint_url=options.s3_endpoint_url)


SCHEDULER_FLAGS = ("--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler")


def check_scheduler_flags(options: CheckpointOptions, *, override: bool, use_checkpoint: bool,
                          source: str = "<command line>") -> None:
    """Megatron-LM's two answers to a step whose learning-rate schedule differs from the flags'
    are about the schedule a resume loads: refused (ConfigError naming the flag) where nothing
    loads one, and together (megatron-core's scheduler asserts on that)."""
    if override and use_checkpoint:
        raise ConfigError(source, SCHEDULER_FLAGS[0], f"given with {SCHEDULER_FLAGS[1]}",
                          "one of them: this run's schedule (override) or the checkpoint's")
    for flag, given in zip(SCHEDULER_FLAGS, (override, use_checkpoint)):
        if not given:
            continue
        if options.load is None:
            raise ConfigError(source, flag, "given without --load",
                              "with --load DIR (it says which schedule a resume continues)")
        if not options.load_optim:
            raise ConfigError(source, flag, "given with "
                              + ("--finetune" if options.finetune else "--no-load-optim"),
                              "not with them: the checkpoint's schedule is not loaded, the "
                              "schedule starts fresh from this run's flags")
