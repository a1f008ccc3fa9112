"""run_schedule: megatron-core's 1F1B across stages of different TP equals one process.

A real megatron-core GPTModel (runtime/stage_model.py, layout-independent initial weights) is
split over a pipeline whose stages have different TP degrees; megatron's own
``forward_backward_pipelining_without_interleaving`` runs it with HeteroP2PCommunicator. The
per-micro-batch losses and every parameter's gradient (TP shards merged, tied embedding copies
summed) must equal those of the whole model run micro-batch by micro-batch in one process. A
deeper (HAPT) warm-up must give bit-identical results: only the timing changes.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading

import pytest
import torch

from helpers.dist_utils import RankFailed, run_on_ranks
from megatron_autohet.errors import ConfigError
from megatron_autohet.layout.topology import rank_role
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.data.batches import microbatches
from megatron_autohet.runtime.loss import masked_token_mean
from megatron_autohet.testing.reference import reference_plan
from megatron_autohet.spec.model import ModelSpec

pytestmark = pytest.mark.integration

MODEL = ModelSpec(name="schedule-test", num_layers=4, hidden_size=64, num_attention_heads=4,
                  ffn_hidden_size=128, vocab_size=200, seq_length=16, num_query_groups=4)
MBS, SEQ, SEED = 2, 16, 1234


def pipeline_plan(tps: list[int], layers: list[tuple[int, int]], num_microbatches: int,
                  warmups: list[int | None] | None = None) -> Plan:
    """One pipeline, stage s on TP tps[s] (ranks numbered stage by stage), validated."""
    warmups = warmups or [None] * len(tps)
    stages, next_rank = [], 0
    for tp, span, warmup in zip(tps, layers, warmups):
        stages.append(Stage(ranks=list(range(next_rank, next_rank + tp)), layers=span,
                            warmup_microbatches=warmup))
        next_rank += tp
    return Plan(cluster="test", model=MODEL, micro_batch_size=MBS,
                global_batch_size=MBS * num_microbatches, seq_length=SEQ,
                ranks=[RankInfo(r, "node", r, "gpu") for r in range(next_rank)],
                pipelines=[Pipeline(stages, num_microbatches)]).validate()


def global_batch(num_microbatches: int) -> dict:
    gen = torch.Generator().manual_seed(7)
    rows = MBS * num_microbatches
    loss_mask = (torch.rand(rows, SEQ, generator=gen) > 0.2).float()
    return {"tokens": torch.randint(0, MODEL.vocab_size, (rows, SEQ), generator=gen),
            "labels": torch.randint(0, MODEL.vocab_size, (rows, SEQ), generator=gen),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(SEQ).repeat(rows, 1)}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output):
        loss = masked_token_mean(output, batch["loss_mask"])
        return loss, {"lm loss": loss.detach().clone()}
    return per_token, loss_func


def _grads(model, state) -> list[tuple]:
    from megatron_autohet.runtime.stage_model import param_layouts
    layouts = param_layouts(model, state)
    return [(layouts[name], bool(getattr(p, "sequence_parallel", False)), p.grad.clone())
            for name, p in model.named_parameters()]


def full_grads(per_rank: list[list[tuple]], stage_of_rank: list) -> dict[str, torch.Tensor]:
    """Whole-model gradients from every rank's shards: TP shards merged (SP-partial norms summed,
    replicated copies checked equal), the copies held by different stages (tied embedding) added."""
    by_stage: dict[tuple, list[tuple]] = {}
    for entries, stage in zip(per_rank, stage_of_rank):
        for layout, sp_partial, grad in entries:
            by_stage.setdefault((layout.global_name, stage), []).append((layout, sp_partial, grad))
    full: dict[str, torch.Tensor] = {}
    for (name, _), shards in by_stage.items():
        shards.sort(key=lambda e: e[0].tp_rank)
        layout, sp_partial, _ = shards[0]
        grads = [g for _, _, g in shards]
        if layout.partition_dim is not None:
            merged = layout.merge(grads)
        elif sp_partial:
            merged = torch.stack(grads).sum(0)
        else:
            for g in grads[1:]:
                torch.testing.assert_close(g, grads[0], rtol=1e-6, atol=1e-7)
            merged = grads[0]
        full[name] = full[name] + merged if name in full else merged
    return full


# ---- the reference: the whole model, micro-batch by micro-batch, in one process --------------

def _reference(rank, world, batch, num_microbatches, padded_vocab):
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    from megatron_autohet.runtime.schedule import run_schedule
    from megatron_autohet.runtime.stage_model import build_stage_model

    plan = reference_plan(MODEL, micro_batch_size=MBS, num_microbatches=num_microbatches,
                          seq_length=SEQ)
    state = build_parallel_state(plan, 0)
    model = build_stage_model(MODEL, state, seed=SEED, padded_vocab=padded_vocab)
    losses = []
    for mb in microbatches(batch, MBS, 0, num_microbatches):
        loss = masked_token_mean(model(mb["tokens"], mb["position_ids"], None,
                                       labels=mb["labels"]), mb["loss_mask"])
        (loss / num_microbatches).backward()
        losses.append(loss.item())
    direct = _grads(model, state)
    # run_schedule's one-stage path (megatron's forward_backward_no_pipelining) on the same data
    model.zero_grad(set_to_none=True)
    stored = run_schedule(forward_step, iter(microbatches(batch, MBS, 0, num_microbatches)),
                          model, state)
    scheduled = [(s["lm loss"].item()) for s in stored]
    return losses, direct, scheduled, _grads(model, state)


def reference(batch, num_microbatches, padded_vocab):
    return run_on_ranks(1, _reference, batch, num_microbatches, padded_vocab, timeout=60)[0]


# ---- the pipeline under test ------------------------------------------------------------------

class _CommunicatorSpy:
    """Records the method calls a stage makes on its communicator and the input gradients it
    hands over (to see megatron's warm-up depth and to compare TP ranks)."""

    def __init__(self, cls):
        calls, grads = self.calls, self.grads = [], []

        class Recording(cls):
            def __getattribute__(self, name):
                if name in ("recv_forward", "send_forward", "recv_backward",
                            "send_forward_recv_backward"):
                    calls.append(name)
                return super().__getattribute__(name)

            def send_backward(self, input_grads, is_first_stage):
                calls.append("send_backward")
                grads.append(_clone(input_grads))
                return super().send_backward(input_grads, is_first_stage)

            def send_backward_recv_forward(self, input_grads, shapes, is_first_stage):
                calls.append("send_backward_recv_forward")
                grads.append(_clone(input_grads))
                return super().send_backward_recv_forward(input_grads, shapes, is_first_stage)
        self.cls = Recording


def _clone(tensors):
    tensors = tensors if isinstance(tensors, list) else [tensors]
    return [None if t is None else t.detach().clone() for t in tensors]


def _pipeline(rank, world, plan, batch, sequence_parallel, padded_vocab, warmup_variants=()):
    from megatron_autohet.runtime import schedule
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    from megatron_autohet.runtime.stage_model import build_stage_model

    state = build_parallel_state(plan, rank)
    model = build_stage_model(MODEL, state, seed=SEED, padded_vocab=padded_vocab,
                              sequence_parallel=sequence_parallel)
    spy = _CommunicatorSpy(schedule.HeteroP2PCommunicator)
    schedule.HeteroP2PCommunicator = spy.cls
    num_microbatches = state.stage.num_microbatches
    runs = []
    for variant in (plan, *warmup_variants):
        model.zero_grad(set_to_none=True)
        spy.calls.clear()
        variant_state = dataclasses.replace(state, role=rank_role(variant, rank))
        stored = schedule.run_schedule(
            forward_step, iter(microbatches(batch, MBS, 0, num_microbatches)), model,
            variant_state, sequence_parallel=sequence_parallel)
        runs.append(([s["lm loss"].item() for s in stored], _grads(model, state),
                     list(spy.calls)))
    # forward only (evaluation): same losses, no gradients
    model.zero_grad(set_to_none=True)
    stored = schedule.run_schedule(
        forward_step, iter(microbatches(batch, MBS, 0, num_microbatches)), model, state,
        sequence_parallel=sequence_parallel, forward_only=True)
    assert [s["lm loss"].item() for s in stored] == runs[0][0]
    assert all(p.grad is None for p in model.parameters())
    return runs, spy.grads


def run_pipeline(plan, batch, *, sequence_parallel=False, warmup_variants=(), timeout=60):
    from megatron_autohet.runtime.stage_model import plan_padded_vocab_size
    return run_on_ranks(plan.world_size, _pipeline, plan, batch, sequence_parallel,
                        plan_padded_vocab_size(plan), warmup_variants, timeout=timeout)


def assert_matches_reference(plan, per_rank, ref):
    ref_losses, ref_direct, ref_scheduled_losses, ref_scheduled = ref
    last = plan.pipelines[0].stages[-1].ranks
    for rank, (runs, _) in enumerate(per_rank):
        losses = runs[0][0]
        if rank in last:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                       rtol=1e-5, atol=0)
        else:
            assert losses == []                 # megatron returns losses on last stages only
    expected = full_grads([ref_direct], [0])
    stages = [(role.stage.pipeline, role.stage.stage)
              for role in (rank_role(plan, rank) for rank in range(plan.world_size))]
    got = full_grads([runs[0][1] for runs, _ in per_rank], stages)
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")


CASES = [([2, 1], [(0, 3), (3, 4)], False), ([2, 1], [(0, 2), (2, 4)], True),
         ([1, 2], [(0, 1), (1, 4)], False), ([1, 2], [(0, 2), (2, 4)], True)]


@pytest.mark.parametrize("tps,layers,sequence_parallel", CASES,
                         ids=[f"tp{'-'.join(map(str, c[0]))}-{'sp' if c[2] else 'nosp'}"
                              for c in CASES])
def test_hetero_tp_pipeline_matches_one_process(tps, layers, sequence_parallel):
    num_microbatches = 3
    plan = pipeline_plan(tps, layers, num_microbatches)
    batch = global_batch(num_microbatches)
    from megatron_autohet.runtime.stage_model import plan_padded_vocab_size
    ref = reference(batch, num_microbatches, plan_padded_vocab_size(plan))
    # megatron's no-pipelining path through run_schedule equals the plain loop
    assert ref[2] == pytest.approx(ref[0], rel=1e-6)
    direct, scheduled = full_grads([ref[1]], [0]), full_grads([ref[3]], [0])
    for name, grad in direct.items():
        torch.testing.assert_close(scheduled[name], grad, rtol=1e-6, atol=1e-8)

    per_rank = run_pipeline(plan, batch, sequence_parallel=sequence_parallel)
    assert_matches_reference(plan, per_rank, ref)

    # Without SP every TP rank of a stage computes the same input gradient (megatron all-reduces
    # the column-parallel input grads), which is why the communicator sends one copy.
    for stage in plan.pipelines[0].stages[1:]:
        sent = [per_rank[r][1] for r in stage.ranks]
        assert len(sent[0]) == num_microbatches
        if not sequence_parallel:
            for other in sent[1:]:
                for a, b in zip(sent[0], other):
                    assert torch.equal(a[0], b[0])


def test_tp_change_inside_pipeline_with_sp():
    """TP2 -> TP1 -> TP2 (the proof plan's shape) with sequence parallelism: 5 processes."""
    num_microbatches = 2
    plan = pipeline_plan([2, 1, 2], [(0, 1), (1, 3), (3, 4)], num_microbatches)
    batch = global_batch(num_microbatches)
    from megatron_autohet.runtime.stage_model import plan_padded_vocab_size
    ref = reference(batch, num_microbatches, plan_padded_vocab_size(plan))
    assert_matches_reference(plan, run_pipeline(plan, batch, sequence_parallel=True), ref)


def valid_warmups(num_stages: int, num_microbatches: int):
    """Every warm-up vector plan validation accepts: non-increasing, >= 1, last stage 0."""
    for head in itertools.product(range(1, num_microbatches + 1), repeat=num_stages - 1):
        if all(a >= b for a, b in zip(head, head[1:])):
            yield [*head, 0]


def test_every_valid_hapt_warmup_gives_identical_results():
    """3 stages (TP2 | TP1 | TP1), 3 micro-batches: all 6 valid warm-up vectors, bit-identical
    losses and gradients to the standard (2, 1, 0); the deepest, (3, 3, 0), runs all forwards of
    stages 0-1 before any backward, so every send of theirs is still in flight when they block."""
    num_microbatches = 3
    tps, layers = [2, 1, 1], [(0, 2), (2, 3), (3, 4)]
    plan = pipeline_plan(tps, layers, num_microbatches)
    variants = [pipeline_plan(tps, layers, num_microbatches, w)
                for w in valid_warmups(3, num_microbatches)]
    assert [[s.warmup_microbatches for s in v.pipelines[0].stages] for v in variants] == [
        [1, 1, 0], [2, 1, 0], [2, 2, 0], [3, 1, 0], [3, 2, 0], [3, 3, 0]]
    per_rank = run_pipeline(plan, global_batch(num_microbatches), warmup_variants=variants)
    for rank, (runs, _) in enumerate(per_rank):
        stage = rank_role(plan, rank).stage.stage
        base_losses, base_grads, _ = runs[0]
        for variant, (losses, grads, calls) in zip([plan, *variants], runs):
            # megatron ran the plan's depth: warm-up = forwards sent before the first 1F1B step
            warmup = variant.pipelines[0].warmup_depths()[stage]
            assert calls.count("send_forward") == warmup, (stage, warmup, calls)
            assert losses == base_losses
            for (layout, _, a), (_, _, b) in zip(base_grads, grads):
                assert torch.equal(a, b), layout.global_name


def test_increasing_warmup_is_rejected_and_would_deadlock(tmp_path):
    with pytest.raises(ConfigError) as info:
        pipeline_plan([1, 1, 1], [(0, 1), (1, 2), (2, 4)], 3, [1, 2, 0])
    assert str(info.value) == (
        "<plan>: field 'pipelines[0].stages[1].warmup_microbatches': 2 > 1 of stage 0 "
        "(allowed: <= 1: warm-up depths must not increase along the pipeline (a deeper stage "
        "after a shallower one deadlocks 1F1B))")
    with pytest.raises(ConfigError, match=r"stages\[1\].warmup_microbatches': 1 on the last"):
        pipeline_plan([1, 1], [(0, 2), (2, 4)], 3, [2, 1])
    with pytest.raises(ConfigError, match=r"stages\[0\].warmup_microbatches': 0 on a stage"):
        pipeline_plan([1, 1], [(0, 2), (2, 4)], 3, [0, 0])
    # What validation prevents: the same depths forced past it hang in megatron's 1F1B.
    plan = pipeline_plan([1, 1, 1], [(0, 1), (1, 2), (2, 4)], 3)
    forced = dataclasses.replace(plan, pipelines=[Pipeline(
        [dataclasses.replace(s, warmup_microbatches=w)
         for s, w in zip(plan.pipelines[0].stages, [1, 2, 0])], 3)])
    with pytest.raises(RankFailed, match=f"died with exit code {HUNG_EXIT}"):
        run_on_ranks(3, _forced_schedule, forced, global_batch(3), tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[:3] == ["0", "1", "2"] and names[3:], names    # all were scheduling, some hung


# How long after every rank began a schedule of three micro-batches it counts as hung, and
# the exit status of a rank whose schedule hung.
HANG_S = 10
HUNG_EXIT = 3


def _forced_schedule(rank, world, plan, batch, marker_dir):
    """run_schedule with a plan that skipped validation (roles computed from it directly)."""
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    from megatron_autohet.runtime.schedule import run_schedule
    from megatron_autohet.runtime.stage_model import build_stage_model, plan_padded_vocab_size

    valid = dataclasses.replace(plan, pipelines=[Pipeline(
        [dataclasses.replace(s, warmup_microbatches=None) for s in plan.pipelines[0].stages],
        plan.pipelines[0].num_microbatches)])
    state = build_parallel_state(valid, rank)
    model = build_stage_model(MODEL, state, seed=SEED, padded_vocab=plan_padded_vocab_size(plan))
    state = dataclasses.replace(state, role=rank_role(plan, rank))
    (marker_dir / str(rank)).touch()
    # Every rank has built its model: the watchdog's wait is the schedule's alone (three
    # micro-batches of a 4-layer model: milliseconds), so running past it is the hang. (The
    # schedule stays on the main thread, where CPU mode's device redirection applies.)
    torch.distributed.barrier()
    done = threading.Event()

    def watchdog():
        if not done.wait(HANG_S):
            (marker_dir / f"hung-{rank}").touch()
            os._exit(HUNG_EXIT)

    threading.Thread(target=watchdog, daemon=True).start()
    run_schedule(forward_step, iter(microbatches(batch, MBS, 0, 3)), model, state)
    done.set()
