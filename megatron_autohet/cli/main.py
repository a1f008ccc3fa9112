"""Entry point of the `autohet` command.

Each sub-command lives in ``megatron_autohet/cli/<name>.py`` and defines
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking the parsed
args and returning an exit status. Sub-command modules import heavy dependencies (torch,
megatron-core, pyscipopt) inside their functions, so `autohet --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from megatron_autohet import __version__
from megatron_autohet.errors import ConfigError
from megatron_autohet.known_warnings import ignore_known_warnings

COMMANDS = ("checkpoint", "compare", "node", "plan", "profile", "rendezvous", "replan", "show",
            "torchrun", "train", "watch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autohet",
        description="Plan and run GPT training on a heterogeneous, preemptible GPU fleet.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"megatron_autohet.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before any sub-command imports megatron-core: its known-benign warnings would repeat on
    # every rank (torchrun's workers run this main too).
    ignore_known_warnings()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "passes_arguments_on", False):
        # another program's arguments (torchrun's, then its script's): all of them, as typed
        words = sys.argv[1:] if argv is None else argv
        args.arguments, unknown = words[words.index(args.command) + 1:], []
    if unknown and not getattr(args, "refuse_unknown", None):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if unknown:
            # a sub-command that says what its unknown arguments are (train: Megatron-LM's
            # flags with what to use instead), in its own one line
            args.refuse_unknown(unknown)
        status = int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"autohet {args.command}: error: {exc}", file=sys.stderr)
        status = 2
    if argv is None and args.command in UNFINALIZED:
        end_process(status)
    return status


# Processes that ran a training job, its torchrun agent or the rendezvous store end without
# Python's finalization (and so do their refusals, which may have imported megatron-core to
# decide):
# with torch and megatron-core imported it costs about 1.2 CPU-s (freeing every module's
# objects), 7-15 s of wall time on a loaded machine, and at an elastic job's end each node waits
# for it twice in a row (its workers, then its agent) - 22 s from the job's `finished` to the
# agents' exit on 4 emulated nodes at load average 20. Nothing is left to finalize by then: the
# last checkpoint is written and uploaded, the process groups are destroyed, every log line
# and JSON line is flushed as it is written (the rendezvous store: nothing but the store).
UNFINALIZED = ("node", "rendezvous", "torchrun", "train")


def end_process(status: int) -> None:
    """Exit now with ``status``, after flushing stdout and stderr (not a library call: only the
    command line's own process, ``main()`` without ``argv``, ends this way)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
