"""Entry point of the `autohet` command.

Each sub-command lives in ``megatron_autohet/cli/<name>.py`` and defines
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking the parsed
args and returning an exit status. Sub-command modules import heavy dependencies (torch,
megatron-core, pyscipopt) inside their functions, so `autohet --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_autohet import __version__
from megatron_autohet.errors import ConfigError
from megatron_autohet.known_warnings import ignore_known_warnings

COMMANDS = ("checkpoint", "compare", "node", "plan", "profile", "rendezvous", "replan", "show",
            "train", "watch")


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
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"autohet {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
