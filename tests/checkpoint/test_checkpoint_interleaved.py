"""A step saved on an interleaved pipeline loads into a plain plan, and back.

Interleaved stages hold several model chunks (``virtual_stages``), but megatron-core keys every
checkpoint entry by its global layer, so nothing in a checkpoint says how a step was cut. Plan I
is tiny-two-pipelines with its [TP2 | TP1] pipeline interleaved (2 chunks per stage, each stage's
chunks far apart in the model) next to its plain [TP1]; plan P is the same fleet without
interleaving. Train ``HALF`` iterations on one and save, resume on the other for the rest: every
iteration's loss and grad norm must equal the uninterrupted run on the first within ``REL``
(the two layouts sum in another order), learning rates exactly.
"""

from __future__ import annotations

import pytest

from megatron_autohet.checkpoint.options import CheckpointOptions
from helpers.checkpointing import HALF, REL, TOTAL, train_job
from helpers.dist_utils import run_on_ranks
from helpers.training import global_batches, interleaved_plan, rel

pytestmark = pytest.mark.integration

COUNTS = {0: 4, 1: 1}        # micro-batches: a multiple of the interleaved pipeline's 2 stages
PLANS = {
    "interleaved": lambda: interleaved_plan(
        "tiny-two-pipelines.yaml", {0: [[(0, 2), (3, 5)], [(2, 3), (5, 6)]]}, COUNTS),
    "plain": lambda: interleaved_plan("tiny-two-pipelines.yaml", {}, COUNTS),
}


@pytest.mark.parametrize("saved_on, resumed_on", [("interleaved", "plain"),
                                                  ("plain", "interleaved")])
def test_step_saved_on_one_layout_resumes_on_the_other(saved_on, resumed_on, tmp_path):
    a, b = PLANS[saved_on](), PLANS[resumed_on]()
    assert a.pipelines[0].interleaved != b.pipelines[0].interleaved
    batches = global_batches(a, TOTAL)
    full = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions())[0]
    first = run_on_ranks(a.world_size, train_job, a, batches,
                         CheckpointOptions(save=str(tmp_path), save_interval=HALF),
                         exit_interval=HALF)[0]
    assert first == full[:HALF]
    rest = run_on_ranks(b.world_size, train_job, b, batches,
                        CheckpointOptions(load=str(tmp_path)))[0]
    resumed = first + rest
    assert len(resumed) == TOTAL
    assert [x[2] for x in resumed] == [y[2] for y in full]          # learning rates
    diffs = [max(rel(x[0], y[0]), rel(x[1], y[1])) for x, y in zip(resumed, full)]
    print(f"saved {saved_on}, resumed {resumed_on}: max relative difference {max(diffs):.2e}")
    assert max(diffs) <= REL, diffs
