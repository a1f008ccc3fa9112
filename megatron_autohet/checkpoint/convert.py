"""Adopting a stock Megatron-LM torch_dist step (``autohet checkpoint convert STOCK_DIR OUT_DIR``).

Stock Megatron-LM (core_v0.16.1, ``--ckpt-format torch_dist``) and our plans write the same
files - DCP data files and ``.metadata``, megatron's ``common.pt`` (the same layout,
checkpoint/state.py) and ``metadata.json`` - so the bytes load as they are. What a stock step lacks
is our manifest (checkpoint/manifest.py), and a step without one does not exist for recovery.
:func:`convert_step` writes it, once, into a copy:

1. Find the step: ``STOCK_DIR`` is Megatron-LM's ``--save`` directory; the step is the one its
   ``latest_checkpointed_iteration.txt`` names, or ``--iteration N``.
2. Check it is a complete torch_dist step before anything is copied: ``metadata.json`` says
   ``torch_dist``; ``.metadata`` (DCP's index) and ``common.pt`` are there; ``common.pt`` loads
   with ``weights_only=True`` and holds Megatron-LM's ``iteration`` (the directory's),
   ``args``, ``opt_param_scheduler`` and ``optimizer``; every data file the index names exists
   and holds every byte range the index gives it. Stock writes a step in place and has no commit
   marker, so this is how a half-written step (an interrupted save) is refused. Whatever is not
   such a step - garbage under the right names included, or a step of ours, which has its
   manifest already - is refused in one line naming the file and what is wrong with it.
3. Copy the step's files into ``OUT_DIR/iter_N.partial``, hash every chunk of the COPIES (a
   checksum per DCP item, the function a save uses: checkpoint/writer.py) and the small files,
   write the manifest and commit as a save does (rename to ``iter_N``,
   ``latest_checkpointed_iteration.txt``). The stock directory is left untouched; from then on
   ``autohet checkpoint ls/verify``, the S3 tier and ``autohet train --load OUT_DIR`` treat the
   step as one of ours.

Why a conversion step rather than loading a stock step directly: recovery never deserializes a
byte it has not checked against the manifest's checksum, and plans its reads, the peer exchange
and S3 downloads from the manifest's chunk index. A direct load would have to give up both for
stock steps (no checksums exist to check against, nothing says the step is complete). A one-time
conversion keeps every load verified, and does its completeness checks where a person sees them.

The manifest's ``plan`` describes the stock job (``cluster`` "megatron-lm (TP.. x PP.. x DP..)",
its ranks, its sizes also in ``extra``): it never equals a plan of ours, so recovery leaves our
RNG restore out (stock's ``rng_state`` objects are not ours), and the resume maps stock's
``common.pt`` like ours (checkpoint/state.py ``apply_loaded``: iteration, ``common_step``,
the scheduler in samples, ``args.consumed_train_samples``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from megatron_autohet.checkpoint.manifest import (LATEST_FILE, MANIFEST_FILE, FileRecord, Manifest,
                                                  checksum_file, commit_step_dir, partial_dir,
                                                  step_dir_name, write_atomic)
from megatron_autohet.errors import ConfigError

STOCK_NODE = "megatron-lm"          # the manifest's node of every file: one shared --save dir
_WRITER = re.compile(r"^__(\d+)_\d+\.distcp$")


def _bad(field: str, problem: str, allowed: str | None = None) -> ConfigError:
    return ConfigError("<command line>", field, problem, allowed)


def _step_dir(stock_root: Path, iteration: int | None) -> tuple[Path, int]:
    if not stock_root.is_dir():
        raise _bad("STOCK_DIR", f"{stock_root}: no such directory")
    field = "STOCK_DIR" if iteration is None else "--iteration"
    if iteration is None:
        latest = stock_root / LATEST_FILE
        text = latest.read_text().strip() if latest.is_file() else ""
        if not text.isdigit():
            raise _bad("STOCK_DIR", f"{latest}: missing or not an iteration (a 'release' "
                       "checkpoint has no training state to resume)",
                       "Megatron-LM's --save directory, or --iteration N")
        iteration = int(text)
    step = stock_root / step_dir_name(iteration)
    if not step.is_dir():
        raise _bad(field, f"{step}: no such step directory")
    if (step / MANIFEST_FILE).is_file():
        raise _bad("STOCK_DIR", f"{step}: a megatron-autohet step already (it has its "
                   f"{MANIFEST_FILE})", "`autohet train --load` it as it is")
    return step, iteration


def _check_common(step: Path, iteration: int) -> dict:
    """common.pt as Megatron-LM reads it (weights_only, megatron's safe globals)."""
    import torch

    import megatron.core  # noqa: F401  registers megatron's safe globals (argparse.Namespace...)

    try:
        common = torch.load(step / "common.pt", map_location="cpu", weights_only=True)
    except Exception as err:                  # unpickling refused or a torn file: say which
        raise _bad("STOCK_DIR", f"{step / 'common.pt'}: not readable with "
                   f"weights_only=True ({type(err).__name__}: {err})") from err
    missing = [k for k in ("iteration", "args", "opt_param_scheduler", "optimizer")
               if k not in common]
    if missing:
        raise _bad("STOCK_DIR", f"{step / 'common.pt'} lacks {', '.join(missing)}",
                   "a training checkpoint of Megatron-LM (not --no-save-optim, not a release)")
    if common["iteration"] != iteration:
        raise _bad("STOCK_DIR", f"{step / 'common.pt'} is of iteration {common['iteration']}, "
                   f"its directory says {iteration}")
    return common


def _check_files(step: Path) -> object:
    """The step's DCP index; every byte range it names must be in its data file."""
    # torch: not at `autohet` start-up
    from torch.distributed.checkpoint import FileSystemReader

    for name in (".metadata", "common.pt", "metadata.json"):
        if not (step / name).is_file():
            raise _bad("STOCK_DIR", f"{step / name}: missing (an interrupted or non-torch_dist "
                       "save)", "a complete --ckpt-format torch_dist step")
    try:
        said = json.loads((step / "metadata.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise _bad("STOCK_DIR", f"{step / 'metadata.json'}: not JSON ({err})",
                   "the metadata.json of a torch_dist step") from None
    backend = said.get("sharded_backend") if isinstance(said, dict) else None
    if backend != "torch_dist":
        raise _bad("STOCK_DIR", f"{step / 'metadata.json'}: sharded_backend {backend!r}",
                   "torch_dist")
    try:
        metadata = FileSystemReader(str(step)).read_metadata()
        storage = metadata.storage_data
        ends: dict[str, int] = {}
        for info in storage.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                           info.offset + info.length)
    except Exception as err:        # noqa: BLE001 - unpickling garbage raises anything
        raise _bad("STOCK_DIR", f"{step / '.metadata'}: not a torch DCP index "
                   f"({type(err).__name__}: {err})") from None
    for name, end in sorted(ends.items()):
        path = step / name
        if not _WRITER.match(name):
            raise _bad("STOCK_DIR", f"{path}: a data file name this command does not know",
                       "DCP's __<rank>_<n>.distcp files")
        if not path.is_file() or path.stat().st_size < end:
            raise _bad("STOCK_DIR", f"{path}: missing or shorter than its {end} indexed bytes "
                       "(an interrupted save)")
    return metadata


_LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "data_parallel_size", "world_size")


def _stock_layout(common: dict) -> dict:
    """The parallel layout Megatron-LM's ``args`` record; None where they do not (a step of
    ours records TP and PP only where every stage has the same, checkpoint/state.py)."""
    args = common["args"]
    return {key: getattr(args, key, None) for key in _LAYOUT_ARGS}


def describe_layout(layout: dict) -> str:
    """What a converted step's ``extra["megatron_lm"]`` says of its layout, e.g. ``TP2 x PP1 x
    DP2, 4 ranks``; only the parts recorded."""
    parts = [f"{name}{layout[key]}" for name, key in zip(("TP", "PP", "DP"), _LAYOUT_ARGS)
             if layout.get(key) is not None]
    said = " x ".join(parts)
    if layout.get("world_size") is not None:
        said += f"{', ' if said else ''}{layout['world_size']} ranks"
    return said or "no parallel layout recorded in its args"


def convert_step(stock_dir, out_dir, *, iteration: int | None = None):
    """Check, copy, hash and commit one stock step (module docstring); returns our Manifest."""
    # torch: not at `autohet` start-up
    from megatron_autohet.checkpoint.writer import SMALL_FILES, own_items

    stock_root, out_root = Path(stock_dir), Path(out_dir)
    if out_root.resolve() == stock_root.resolve():
        raise _bad("OUT_DIR", f"{out_root} is STOCK_DIR", "another directory (the stock step "
                   "stays as Megatron-LM wrote it)")
    step, iteration = _step_dir(stock_root, iteration)
    metadata = _check_files(step)
    common = _check_common(step, iteration)
    layout = _stock_layout(common)
    data_files = sorted({info.relative_path for info in metadata.storage_data.values()})

    staged = partial_dir(out_root, iteration)
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    for name in [*SMALL_FILES, *data_files]:
        shutil.copyfile(step / name, staged / name)
    writers = sorted({int(_WRITER.match(name).group(1)) for name in data_files})
    items, files = [], {}
    for rank in writers:
        rank_items, rank_files = own_items(metadata, metadata.storage_data, staged, rank,
                                            STOCK_NODE)
        items += rank_items
        files.update({f.name: f for f in rank_files})
    for name in SMALL_FILES:
        files[name] = FileRecord(name=name, size=(staged / name).stat().st_size, rank=0,
                                 node=STOCK_NODE, digest=checksum_file(staged / name))
    world = max(layout["world_size"] or 0, writers[-1] + 1 if writers else 1)
    tp, pp, dp = (layout[k] or 1 for k in _LAYOUT_ARGS[:3])
    # Plan-shaped for `autohet checkpoint ls` (ranks, one pipeline per data-parallel replica);
    # never equal to a plan of ours, so recovery does not restore RNG states from it.
    plan = {"cluster": f"{STOCK_NODE} (TP{tp} x PP{pp} x DP{dp})", "pipelines": [{}] * dp,
            "ranks": [{"rank": r, "node": STOCK_NODE} for r in range(world)]}
    manifest = Manifest(iteration=iteration, files=files, items=items, plan=plan,
                        extra={"converted_from": str(step.resolve()), "megatron_lm": layout})
    write_atomic(staged / MANIFEST_FILE, manifest.to_json())
    commit_step_dir(out_root, iteration)
    return manifest
