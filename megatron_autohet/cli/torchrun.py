"""`autohet torchrun`: torchrun for Megatron-LM's ``pretrain_gpt.py --autohet-plan``, checked first.

    autohet torchrun [torchrun's options] pretrain_gpt.py --autohet-plan PLAN [its arguments]

takes exactly what ``torchrun`` takes (torch.distributed.run's own parser) and differs in two
ways:

* before any process starts, it makes the checks the ranks would make on the script's
  ``--autohet-*`` and Megatron-LM flags wherever no rank is needed: the flags the plan path
  refuses, Megatron-LM's own argument checks, the tokenizer's vocabulary and every model and
  batch flag against the plan, the processes torchrun would start (``--nnodes`` x
  ``--nproc-per-node``) against the plan's ranks, ``--data-path`` and ``--load``, and whether
  a one-node job's plan fits this machine. A mistake is one line and status 2;
* a job that fails ends with one line, ``rank R exited with status S; its lines are above``,
  and status S, instead of torchrun's ChildFailedError summary (a traceback of torchrun).

Without ``--autohet-plan`` among the script's arguments it is plain torchrun with that ending.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from megatron_autohet.cli.train import check_resume, check_runs_here, gpu_count
from megatron_autohet.errors import ConfigError
from megatron_autohet.megatron.hooks import check_before_launch
from megatron_autohet.plan import load_plan

PROG = "autohet torchrun"
AGENT_FAILURE_LINES = ("failed (exitcode", "Sending process")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "torchrun", add_help=False,
        help="torchrun for Megatron-LM's pretrain_gpt.py --autohet-plan: its mistakes refused "
             "before any process starts, a failed job's end in one line",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # cli/main.py hands every argument after `torchrun` on as it was typed (they are
    # torchrun's and the script's, which this parser does not know)
    p.set_defaults(func=run, passes_arguments_on=True)


def run(args: argparse.Namespace) -> int:
    # torch: torchrun's parser and agent, after `autohet` start-up
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, get_args_parser
    from torch.distributed.run import run as torchrun

    parser = get_args_parser()
    parser.prog = PROG
    if not args.arguments or args.arguments[0] in ("-h", "--help"):
        print(__doc__.strip(), end="\n\n")
        parser.print_help()
        return 0
    parser.error = _refuse_in_one_line
    launch = parser.parse_args(args.arguments)
    if _has_plan(launch.training_script_args):
        check_launch(launch)
    if determine_local_world_size(launch.nproc_per_node) > 1:
        # torchrun's own default for several processes a node, without its four-line banner
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the agent's lines on a failed rank and the others it stops: this command's own last line
    # says which rank failed, and how
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not record.getMessage().startswith(AGENT_FAILURE_LINES))
    try:
        torchrun(launch)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        if failure.exitcode > 0:
            print(f"{PROG}: rank {rank} exited with status {failure.exitcode}; its lines are "
                  "above", file=sys.stderr)
            return failure.exitcode
        print(f"{PROG}: rank {rank} was ended by signal {-failure.exitcode}; its lines are "
              "above", file=sys.stderr)
        return 128 - failure.exitcode
    except SignalException as stopped:
        # torchrun's agent passed the signal on to the ranks and waited for them
        return 128 + int(stopped.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


def check_launch(launch: argparse.Namespace) -> None:
    """The checks of the module docstring, on torchrun's parsed options ``launch``."""
    script = Path(launch.training_script)
    if launch.module or launch.no_python or not script.is_file():
        raise ConfigError("<command line>", "training_script", f"{launch.training_script} is "
                          "not a Python file", "Megatron-LM's pretrain_gpt.py (its path), as "
                          "with --autohet-plan")
    # As Python runs a script: its directory first on the path (Megatron-LM's `megatron`).
    sys.path.insert(0, str(script.resolve().parent))
    try:
        import megatron.training.arguments  # noqa: F401  (Megatron-LM's training package)
    except ImportError as err:
        raise ConfigError("<command line>", "training_script", f"{script}: Megatron-LM's "
                          f"training package does not import beside it ({err})",
                          "pretrain_gpt.py of a Megatron-LM checkout set up by "
                          "scripts/setup_megatron_lm.sh") from None
    nodes, world_size = _processes(launch)
    planned = load_plan(options_plan(launch)).world_size
    if world_size is not None and world_size != planned:
        flag = "--nproc-per-node" if nodes == 1 else "--nnodes x --nproc-per-node"
        raise ConfigError("<command line>", flag, f"torchrun would start {world_size} "
                          f"processes, the plan {options_plan(launch)} has {planned} ranks",
                          f"{planned} processes in all (one per planned GPU)")
    plan, options = check_before_launch(launch.training_script_args, planned)
    check_resume(options.checkpoint, plan, None, options.iters, model_file=options_plan(launch))
    if nodes == 1:
        check_runs_here(plan, options_plan(launch), gpu_count,
                        command=f"{launch.training_script} ... (`{PROG}` on each node)")


def options_plan(launch: argparse.Namespace) -> str:
    """The script's ``--autohet-plan`` file."""
    argv = launch.training_script_args
    for i, arg in enumerate(argv):
        if arg.startswith("--autohet-plan="):
            return arg.split("=", 1)[1]
        if arg == "--autohet-plan" and i + 1 < len(argv):
            return argv[i + 1]
    return "--autohet-plan"


def _has_plan(argv: list[str]) -> bool:
    return any(a == "--autohet-plan" or a.startswith("--autohet-plan=") for a in argv)


def _processes(launch: argparse.Namespace) -> tuple[int | None, int | None]:
    """(nodes, processes in all) torchrun starts, where its options fix them (an elastic node
    range, or --nproc-per-node gpu/auto/xpu, leave the count to the machines: None)."""
    nodes = launch.nnodes.split(":")
    fixed_nodes = int(nodes[0]) if len(nodes) == 1 or nodes[0] == nodes[1] else None
    try:
        per_node = int(launch.nproc_per_node)
    except ValueError:
        return fixed_nodes, None
    return fixed_nodes, None if fixed_nodes is None else fixed_nodes * per_node


def _refuse_in_one_line(message: str):
    raise ConfigError("<command line>", "torchrun's options", message,
                      f"`{PROG} --help` lists them")
