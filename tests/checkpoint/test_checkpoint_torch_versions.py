"""A checkpoint step is written the same way on every torch release the package accepts.

torch 2.11 changed what ``torch.distributed.checkpoint.save`` returns: the coordinator's
``FileSystemWriter.finish`` now records the chunk locations (``storage_data``) on a copy of the
Metadata (``dataclasses.replace``), so the Metadata returned to every rank has
``storage_data = None``. A writer that read chunk locations from it failed every save on such a
torch (on the GPU machine: ``AttributeError: 'NoneType' object has no attribute 'items'``).

The tests run the real two-rank save twice: with the installed torch's ``finish``, and with a
``finish`` that behaves as torch 2.11's does (fills a copy, as its source does) whatever torch is
installed. Both must commit a step whose manifest lists exactly the chunks of DCP's ``.metadata``
file at their byte ranges, with checksums that verify.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

from helpers.dist_utils import run_on_ranks
from megatron_autohet.checkpoint.inspect import verify_local
from megatron_autohet.checkpoint.manifest import read_manifest, step_dir_name
from megatron_autohet.plan import load_plan

pytestmark = pytest.mark.integration

PLANS = Path(__file__).resolve().parents[2] / "configs" / "plans"


def _save(rank, world, root, finish_fills_a_copy):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemWriter

    from megatron_autohet.checkpoint.writer import StepDirs, write_step

    if finish_fills_a_copy:
        finish = FileSystemWriter.finish

        def finish_on_a_copy(self, metadata, results):    # torch 2.11's FileSystemWriter.finish
            return finish(self, dataclasses.replace(metadata), results)

        FileSystemWriter.finish = finish_on_a_copy
    plan = load_plan(PLANS / "tiny-homogeneous.yaml")
    # Rank r holds rows [4r, 4r + 4) of one global (4 * world, 3) tensor, and an object.
    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * rank
    state = {"weight": ShardedTensor.from_rank_offsets("weight", weight, (0, rank, world))}
    dirs = StepDirs.shared(root, world)
    write_step(state, {"note": "test"}, iteration=3, plan=plan, rank=rank, dirs=dirs,
               group=None)
    return True


@pytest.mark.parametrize("finish_fills_a_copy", [False, True],
                         ids=["installed-torch", "torch-2.11-finish"])
def test_step_manifest_matches_dcp_index(tmp_path, finish_fills_a_copy):
    plan = load_plan(PLANS / "tiny-homogeneous.yaml")
    world = len(plan.ranks)
    run_on_ranks(world, _save, tmp_path, finish_fills_a_copy)

    step = tmp_path / step_dir_name(3)
    manifest = read_manifest(step)
    assert manifest is not None, "the step was not committed"
    index = pickle.loads((step / ".metadata").read_bytes())
    expected = {(i.fqn, tuple(i.offset)): (info.relative_path, info.offset, info.length)
                for i, info in index.storage_data.items()}
    listed = {(item.key, item.offsets): (item.file, item.offset, item.length)
              for item in manifest.items}
    assert listed == expected
    assert len(expected) == world
    report = verify_local(step)
    assert not report.problems, report.problems
