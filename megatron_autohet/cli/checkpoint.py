"""`autohet checkpoint ls | verify`: what checkpoint steps a directory or S3 prefix holds, and
whether their bytes still match the manifest's checksums - before a job is pointed at them.

Torch-free (checkpoint/inspect.py; boto3 only for an s3:// location), so both answer at once.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import partial
from pathlib import Path

from tqdm import tqdm

from megatron_autohet.checkpoint.convert import convert_step, describe_layout
from megatron_autohet.checkpoint.inspect import (committed_s3, existing_dirs, list_local, list_s3,
                                                 verify_local, verify_s3)
from megatron_autohet.checkpoint.manifest import committed_steps, step_dir_name
from megatron_autohet.checkpoint.options import CheckpointOptions, object_store
from megatron_autohet.cli._table import format_table
from megatron_autohet.errors import ConfigError

LOCATION = "DIR_OR_S3URI"
LOCATION_ALLOWED = ("a checkpoint directory (--save or --autohet-local-ckpt-dir; '{node}' in the "
                    "path stands for every node's directory) or s3://BUCKET/PREFIX")
ENDPOINT = "--autohet-s3-endpoint-url"
LOCATION_HELP = ("a checkpoint directory (holding iter_NNNNNNN/), a node-local directory "
                 "template with '{node}' (every existing node directory), or s3://BUCKET/PREFIX")
ENDPOINT_HELP = ("S3 endpoint for an s3:// location (MinIO, moto, ...); default: AWS. Credentials "
                 "come from boto3's standard chain (environment, ~/.aws, instance metadata)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "checkpoint", help="list checkpoint steps, verify their checksums, adopt a "
                           "stock Megatron-LM step",
        description="Inspect checkpoints written by `autohet train --save/--autohet-local-ckpt-"
                    "dir` or uploaded to S3, without loading them (no torch, no GPU); convert a "
                    "stock Megatron-LM torch_dist step into one of ours.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    ls = actions.add_parser(
        "ls", help="list the steps with their plan, completeness and size",
        description="One row per step directory, oldest first: whether it is complete (its "
                    "manifest is there and so is every file this copy should hold, with the "
                    "manifest's size), files and MiB present out of those the manifest lists "
                    "(a node-local directory holds only its node's data files), the plan that "
                    "saved it (ranks, pipelines, cluster), and which step "
                    "latest_checkpointed_iteration.txt names. Incomplete steps (no manifest, "
                    "e.g. iter_0000008.partial from an interrupted save) say why. Reads sizes "
                    "only; `verify` re-hashes the bytes.")
    ls.add_argument("location", metavar=LOCATION, help=LOCATION_HELP)
    ls.add_argument(ENDPOINT, default=None, metavar="URL", help=ENDPOINT_HELP)
    ls.add_argument("--json", action="store_true",
                    help="print the steps as a JSON list on stdout instead of a table")
    ls.set_defaults(func=run_ls)

    verify = actions.add_parser(
        "verify", help="re-hash every chunk of a step against its manifest",
        description="Re-hash every chunk (DCP item) of every data file the copy should hold, "
                    "and the small files (.metadata, common.pt, metadata.json), against the "
                    "checksum in the step's manifest (xxh3_128; SHA-256 in a manifest of format "
                    "version 1): each problem is one line (file, byte range, checkpoint key, "
                    "'checksum mismatch' / 'truncated' / 'missing file'; a data "
                    "file cut short is one line), then a summary. Data files of other nodes' "
                    "ranks are not expected in a node-local directory. Exit status: 0 everything "
                    "present checks out, 1 corruption found, 2 bad input.")
    verify.add_argument("location", metavar=LOCATION, help=LOCATION_HELP)
    verify.add_argument("--iteration", type=int, default=None, metavar="N",
                        help="the step to verify (default: the newest committed step, i.e. the "
                             "newest with a manifest: the one a job would load)")
    verify.add_argument(ENDPOINT, default=None, metavar="URL", help=ENDPOINT_HELP)
    verify.set_defaults(func=run_verify)
    add_convert_action(actions)


# ---- locations -------------------------------------------------------------------------------

def local_roots(location: str) -> list[Path]:
    """The directory, or every existing directory the ``{node}`` template matches."""
    roots = existing_dirs(location)
    if not roots:
        problem = (f"{location}: no such directory" if "{node}" not in location
                   else f"no directory matches {location}")
        raise ConfigError("<command line>", LOCATION, problem, LOCATION_ALLOWED)
    return roots


def open_store(args):
    """The S3 tier at an s3:// location (boto3 is imported only then)."""
    return object_store(CheckpointOptions(s3_uri=args.location,
                                          s3_endpoint_url=args.autohet_s3_endpoint_url),
                        flag=LOCATION)


def is_s3(args) -> bool:
    if args.location.startswith("s3://"):
        return True
    if args.autohet_s3_endpoint_url is not None:
        raise ConfigError("<command line>", ENDPOINT, f"given with the local directory "
                          f"{args.location}", "only with an s3:// location")
    return False


def s3_errors_as_config_errors(fn):
    """An S3 failure (unreachable endpoint, no such bucket, no permission) is a location that
    cannot be read: one line and exit 2, like other bad input, not a traceback."""
    def wrapped(args) -> int:
        if not is_s3(args):
            return fn(args)
        # boto3: not at `autohet` start-up
        from megatron_autohet.checkpoint.s3_store import S3Error
        try:
            return fn(args)
        except S3Error as exc:
            raise ConfigError("<command line>", LOCATION, str(exc)) from exc
    return wrapped


# ---- ls ----------------------------------------------------------------------------------------

def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def format_steps(steps) -> str:
    """One row per step; the "why incomplete" column only when a step is."""
    header = ["iteration", "latest", "complete", "files", "MiB", "saved by plan",
              "data of nodes", "where"]
    with_reason = any(s.reason for s in steps)
    rows = []
    for s in steps:
        row = [s.iteration, "yes" if s.latest else "", "yes" if s.complete else "no",
               f"{s.files_present}/{'-' if s.files_listed is None else s.files_listed}",
               f"{_mib(s.bytes_present)}/{_mib(s.bytes_listed)}",
               "-" if s.world_size is None else
               f"{s.world_size} ranks, {s.pipelines} pipelines, {s.cluster}",
               ",".join(s.nodes_served) or "-", s.where]
        rows.append(row + [s.reason or ""] if with_reason else row)
    return format_table(header + ["why incomplete"] if with_reason else header, rows)


@s3_errors_as_config_errors
def run_ls(args) -> int:
    if is_s3(args):
        steps = list_s3(open_store(args))
    else:
        steps = [s for root in local_roots(args.location) for s in list_local(root)]
    if args.json:
        print(json.dumps([asdict(s) for s in steps], indent=1))
    elif not steps:
        print(f"no checkpoint steps (iter_NNNNNNN) in {args.location}")
    else:
        print(format_steps(steps))
    return 0


# ---- verify ------------------------------------------------------------------------------------

def choose_iteration(where: str, committed: list[int], wanted: int | None) -> int:
    if not committed:
        raise ConfigError("<command line>", LOCATION, f"{where}: no committed step (an "
                          "iter_NNNNNNN with autohet-manifest.json)", LOCATION_ALLOWED)
    if wanted is None:
        return committed[-1]
    if wanted not in committed:
        raise ConfigError("<command line>", "--iteration", f"no committed step {wanted} in "
                          f"{where}", f"one of {', '.join(map(str, committed))}")
    return wanted


def print_report(report) -> None:
    for problem in report.problems:
        print(problem)
    verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
    line = (f"> {report.where}: {verdict}; checked {report.items_checked} chunks in "
            f"{report.files_checked} files ({report.bytes_checked / 2**20:.1f} MiB)")
    if report.elsewhere:
        line += (f"; {len(report.elsewhere)} data files of other nodes' ranks are not kept "
                 "here")
    print(line)


@s3_errors_as_config_errors
def run_verify(args) -> int:
    # Every step is chosen (and a bad --iteration reported) before any byte is read.
    if is_s3(args):
        store = open_store(args)
        iteration = choose_iteration(store.location.uri(), committed_s3(store), args.iteration)
        jobs = [partial(verify_s3, store, iteration)]
    else:
        jobs = [partial(verify_local, root / step_dir_name(
                    choose_iteration(str(root), committed_steps(root), args.iteration)))
                for root in local_roots(args.location)]
    ok = True
    for job in jobs:
        with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="verifying", leave=False,
                  disable=None) as bar:          # None: no bar when stderr is not a terminal
            report = job(progress=bar)
        print_report(report)
        ok = ok and report.ok
    return 0 if ok else 1


def add_convert_action(actions) -> None:
    convert = actions.add_parser(
        "convert", help="adopt a stock Megatron-LM torch_dist checkpoint step (write our manifest)",
        description="Check that a step of stock Megatron-LM (--ckpt-format torch_dist) is "
                    "complete, copy it to OUT_DIR, hash every chunk of the copy and "
                    "commit it with our manifest, so that `autohet train --load OUT_DIR` (any "
                    "plan), `autohet checkpoint ls/verify` and the S3 tier accept it. The stock "
                    "directory is not modified.")
    convert.add_argument("stock_dir", metavar="STOCK_DIR",
                         help="stock Megatron-LM's --save directory (holding iter_NNNNNNN/)")
    convert.add_argument("out_dir", metavar="OUT_DIR",
                         help="where the converted step goes (iter_NNNNNNN/ + "
                              "latest_checkpointed_iteration.txt); not STOCK_DIR")
    convert.add_argument("--iteration", type=int, default=None, metavar="N",
                         help="the step to convert (default: the one "
                              "latest_checkpointed_iteration.txt names)")
    convert.set_defaults(func=run_convert)


def run_convert(args) -> int:
    manifest = convert_step(args.stock_dir, args.out_dir, iteration=args.iteration)
    print(f"converted iteration {manifest.iteration} of {args.stock_dir} "
          f"({describe_layout(manifest.extra['megatron_lm'])}): {len(manifest.items)} chunks in "
          f"{len(manifest.files)} files ({manifest.total_bytes / 2**20:.1f} MiB) hashed and "
          f"committed to {Path(args.out_dir) / ('iter_%07d' % manifest.iteration)}")
    return 0
