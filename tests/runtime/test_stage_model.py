"""Stage model, layout-independent init and the single-process reference.

The central proof: stock megatron-core on TP2 x PP2 (its own parallel_state, DDP, schedule,
optimizer and tied-embedding handling) started from our layout-independent weights trains exactly
like testing/reference.py in one process. It can only pass if the init slices every parameter the
way megatron shards it (fused QKV, row/column parallel, vocab-parallel embedding, tied output).
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers.dist_utils import run_on_ranks
from megatron_autohet.layout.params import ParamLayout
from megatron_autohet.plan import Pipeline, RankInfo, Stage, load_plan
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.spec.model import load_model

ROOT = Path(__file__).resolve().parents[2]
PLAN_FILE = ROOT / "configs" / "plans" / "tiny-two-pipelines.yaml"
TINY = load_model(ROOT / "configs" / "models" / "tiny.yaml")
# SwiGLU + RMSNorm + rope + GQA (2 query groups for 4 heads), untied: the LLaMA-style paths.
LLAMA_TINY = replace(TINY, name="llama-tiny", num_layers=2, num_query_groups=2,
                     gated_linear_unit=True, position_embedding_type="rope",
                     tie_embeddings=False)
SEQ = 32
SEED = 1234
# constant learning rate: the stock trainer runs without a scheduler here
OPTIMIZER = OptimizerSettings(lr=1e-3, clip_grad=1.0, lr_decay_style="constant")


def global_batches(model, count, rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, model.vocab_size, (rows, SEQ + 1), generator=gen)
        mask = (torch.rand(rows, SEQ, generator=gen) > 0.2).float()
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": mask,
                    "position_ids": torch.arange(SEQ).expand(rows, SEQ).contiguous()})
    return out


def one_pipeline_plan(model, stages, num_microbatches, micro_batch_size=2):
    world = sum(len(ranks) for ranks, _ in stages)
    from megatron_autohet.plan import Plan
    return Plan(cluster="test", model=model, micro_batch_size=micro_batch_size,
                global_batch_size=micro_batch_size * num_microbatches, seq_length=SEQ,
                ranks=[RankInfo(r, "node", r, "GPU") for r in range(world)],
                pipelines=[Pipeline([Stage(list(ranks), layers) for ranks, layers in stages],
                                    num_microbatches)]).validate()


def _reference(rank, world, model, batches, padded_vocab, micro_batch_size=2):
    from megatron_autohet.testing.reference import run_reference
    return run_reference(model, batches, micro_batch_size=micro_batch_size, seed=SEED,
                         optimizer=OPTIMIZER, padded_vocab=padded_vocab)


# ---- stock megatron-core TP2 x PP2 ----------------------------------------------------------

def _stock_megatron_tp2_pp2(rank, world, batches):
    from megatron_autohet.testing.stock import StockMegatronTrainer

    # Megatron's rank order for TP2 x PP2: TP groups {0,1}, {2,3}; stage 0 = {0,1}.
    plan = one_pipeline_plan(TINY, [([0, 1], (0, 3)), ([2, 3], (3, 6))], num_microbatches=4)
    trainer = StockMegatronTrainer(plan, rank=rank, seed=SEED, optimizer=OPTIMIZER)
    results = []
    for batch in batches:
        step = trainer.train_step(batch)
        loss = sum(step.losses) / 4 if step.losses else None
        results.append((loss, step.grad_norm))
    trainer.close()
    return results


@pytest.mark.integration
def test_stock_megatron_tp2_pp2_matches_single_process_reference():
    batches = global_batches(TINY, count=1, rows=8) * 3        # same batch: the loss must fall
    padded = TINY.padded_vocab_size([2])
    reference = run_on_ranks(1, _reference, TINY, batches, padded)[0]
    stock = run_on_ranks(4, _stock_megatron_tp2_pp2, batches, timeout=180)
    last_stage = stock[2]
    assert stock[3] == last_stage                          # TP ranks of the last stage agree
    assert len(reference) == 3 and reference[0].loss > 5.0   # ~ln(512): an untrained model
    assert reference[2].loss < reference[1].loss < reference[0].loss
    for step, (ref, (loss, grad_norm)) in enumerate(zip(reference, last_stage)):
        assert loss == pytest.approx(ref.loss, rel=1e-5), step
        assert grad_norm == pytest.approx(ref.grad_norm, rel=1e-5), step
    for rank in range(4):                                  # every rank reports the same norm
        assert [g for _, g in stock[rank]] == pytest.approx([g for _, g in last_stage], rel=1e-6)


# ---- heterogeneous stages hold slices of one model -------------------------------------------

def _stage_params(rank, world):
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    from megatron_autohet.runtime.stage_model import build_stage_model, param_layouts
    plan = load_plan(PLAN_FILE)
    state = build_parallel_state(plan, rank)
    model = build_stage_model(plan.model, state, seed=SEED)
    layouts = param_layouts(model, state)
    return ([layer.layer_number for layer in model.decoder.layers],
            {n: (layouts[n], p.detach().clone()) for n, p in model.named_parameters()})


@pytest.mark.integration
def test_heterogeneous_stages_hold_slices_of_the_same_model():
    out = run_on_ranks(4, _stage_params)
    assert [numbers for numbers, _ in out] == [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6],
                                               [1, 2, 3, 4, 5, 6]]
    full_model = {layout.global_name: value for layout, value in out[3][1].values()}
    assert len(full_model) == len(out[3][1])               # rank 3 holds the whole model
    seen = set()
    for local_name, (layout, shard0) in out[0][1].items():          # TP2 stage, layers 0-3
        layout1, shard1 = out[1][1][local_name]
        assert layout1.global_name == layout.global_name and layout1.tp_rank == 1
        merged = layout.merge([shard0, shard1])
        assert torch.equal(merged, full_model[layout.global_name]), layout.global_name
        seen.add(layout.global_name)
    for layout, value in out[2][1].values():                         # TP1 stage, layers 4-5
        assert torch.equal(value, full_model[layout.global_name]), layout.global_name
        seen.add(layout.global_name)
    assert seen == set(full_model)                    # pipeline 0 holds every parameter once
    tied = out[2][1]["output_layer.weight"]           # the last stage's tied copy
    assert tied[0].global_name == "embedding.word_embeddings.weight"
    assert torch.equal(tied[1], full_model["embedding.word_embeddings.weight"])
    assert full_model["embedding.word_embeddings.weight"].abs().sum() > 0


# ---- SwiGLU / GQA / rope / untied: TP2 gradients are slices of TP1 gradients -----------------

def _grads_of_one_stage(rank, world, model_spec, batch, sequence_parallel=False):
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    from megatron_autohet.runtime.stage_model import build_stage_model, param_layouts
    from megatron_autohet.runtime.loss import masked_token_mean
    plan = one_pipeline_plan(model_spec, [(list(range(world)), (0, model_spec.num_layers))], 1)
    state = build_parallel_state(plan, rank)
    model = build_stage_model(model_spec, state, seed=SEED, padded_vocab=512,
                              sequence_parallel=sequence_parallel)
    loss = masked_token_mean(model(batch["tokens"], batch["position_ids"], None,
                                   labels=batch["labels"]), batch["loss_mask"])
    loss.backward()
    layouts = param_layouts(model, state)
    return loss.item(), {n: (layouts[n], p.grad.clone()) for n, p in model.named_parameters()}


@pytest.mark.integration
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_llama_style_tp2_gradients_are_slices_of_tp1_gradients(sequence_parallel):
    batch = {k: v[:2] for k, v in global_batches(LLAMA_TINY, 1, rows=2)[0].items()}
    (loss1, grads1), = run_on_ranks(1, _grads_of_one_stage, LLAMA_TINY, batch)
    tp2 = run_on_ranks(2, _grads_of_one_stage, LLAMA_TINY, batch, sequence_parallel)
    assert tp2[0][0] == pytest.approx(loss1, rel=1e-6) and tp2[1][0] == pytest.approx(loss1,
                                                                                       rel=1e-6)
    full = {layout.global_name: grad for layout, grad in grads1.values()}
    chunked = [n for n, (layout, _) in tp2[0][1].items() if layout.num_chunks == 2]
    assert chunked == ["decoder.layers.0.mlp.linear_fc1.weight",
                       "decoder.layers.1.mlp.linear_fc1.weight"]
    assert "output_layer.weight" in tp2[0][1]                         # untied
    for name, (layout, grad0) in tp2[0][1].items():
        grad1 = tp2[1][1][name][1]
        if sequence_parallel and "layernorm" in name:
            # each TP rank saw half of the sequence: the norms' gradients are partial sums
            # (the grad sync adds them over TP, as Megatron's finalize_model_grads does)
            assert not torch.allclose(grad0, full[layout.global_name])
            grad0 = grad1 = grad0 + grad1
        merged = layout.merge([grad0, grad1])
        torch.testing.assert_close(merged, full[layout.global_name], rtol=1e-4, atol=1e-7,
                                   msg=layout.global_name)


# ---- ParamLayout / padding units -------------------------------------------------------------

def _part_param_counts(rank, world, model_spec):
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    from megatron_autohet.runtime.stage_model import build_stage_model
    plan = one_pipeline_plan(model_spec, [([0], (0, model_spec.num_layers))], num_microbatches=1)
    model = build_stage_model(model_spec, build_parallel_state(plan, rank), seed=SEED)

    def count(module):
        return sum(p.numel() for p in module.parameters())

    # A single stage holds the tied output weight once (the embedding's); a last stage of a
    # deeper pipeline holds its own copy, which is what the estimate's output part counts.
    output_weight = (model.output_layer.weight if model.output_layer.weight is not None
                     else model.embedding.word_embeddings.weight).numel()
    return ([count(layer) for layer in model.decoder.layers], count(model.embedding),
            count(model.decoder.final_layernorm) + output_weight,
            type(model.decoder.final_layernorm).__name__)


@pytest.mark.integration
@pytest.mark.parametrize("model_spec, norm", [(TINY, "LayerNorm"), (LLAMA_TINY, "RMSNorm")])
def test_estimated_parameter_counts_equal_megatron_cores_modules(model_spec, norm):
    from megatron_autohet.profiling.estimate import estimate_entry
    from megatron_autohet.spec.gpus import load_gpu_catalog
    layers, embedding, output, norm_type = run_on_ranks(1, _part_param_counts, model_spec)[0]
    assert norm_type == norm
    estimate = estimate_entry(model_spec, load_gpu_catalog()["A100-80GB"], 1, 1,
                              model_spec.seq_length, 300)
    assert layers == [estimate.layer.param_count] * model_spec.num_layers
    assert embedding == estimate.embedding.param_count
    assert output == estimate.output.param_count


@pytest.mark.unit
def test_param_layout_shard_merge_round_trip_with_chunks():
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    layouts = [ParamLayout("x", (8, 3), 0, r, 2, num_chunks=2) for r in range(2)]
    shards = [layout.shard(full) for layout in layouts]
    assert shards[0][:, 0].tolist() == [0, 3, 12, 15]       # rows 0,1 of each half
    assert torch.equal(layouts[0].merge(shards), full)
    row = ParamLayout("y", (2, 4), 1, 1, 2)
    assert row.local_shape == (2, 2)
    assert torch.equal(row.shard(torch.eye(2, 4)), torch.eye(2, 4)[:, 2:])
    with pytest.raises(ValueError, match="expected"):
        row.shard(torch.zeros(3, 4))


@pytest.mark.unit
def test_padded_vocab_is_shared_by_every_tp_degree_of_a_plan():
    from megatron_autohet.runtime.stage_model import plan_padded_vocab_size
    gpt = replace(TINY, vocab_size=50257)
    assert gpt.padded_vocab_size([1]) == 50304                  # Megatron's 128 * TP rule
    assert gpt.padded_vocab_size([2]) == 50432
    assert gpt.padded_vocab_size([2, 4, 1]) == 50688            # 128 * lcm = 512
    assert plan_padded_vocab_size(load_plan(PLAN_FILE)) == 512


@pytest.mark.unit
def test_stock_baseline_refuses_plans_megatron_cannot_express():
    from megatron_autohet.testing.stock import check_homogeneous
    check_homogeneous(load_plan(PLAN_FILE.with_name("tiny-homogeneous.yaml")))
    with pytest.raises(ValueError, match="not homogeneous"):
        check_homogeneous(load_plan(PLAN_FILE))                  # [TP2 | TP1] next to [TP1]
    swapped = one_pipeline_plan(TINY, [([1, 0], (0, 3)), ([2, 3], (3, 6))], num_microbatches=4)
    with pytest.raises(ValueError, match="default order"):
        check_homogeneous(swapped)
