"""Built-in corpus -> megatron indexed dataset -> GPTDataset -> global batches."""

import numpy as np
import pytest
import torch

from megatron_autohet.data.batches import BATCH_KEYS, DataOptions, build_global_batches
from megatron_autohet.data.indexed import check_prefixes
from megatron_autohet.data.corpus import (build_corpus, byte_tokenizer, corpus_prefix,
                                          stdlib_documents)
from megatron_autohet.errors import ConfigError

SMALL = 64 * 1024           # corpus budget for the tests: a few hundred documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("data"), max_bytes=SMALL)


@pytest.mark.integration
def test_corpus_is_an_indexed_dataset_of_the_stdlib_docstrings(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(corpus))
    tokenizer = byte_tokenizer(512)
    docs = list(zip(range(len(dataset)), stdlib_documents()))
    assert len(dataset) > 50
    assert sum(len(dataset[i]) for i in range(len(dataset))) >= SMALL
    for i, doc in docs[:20]:                    # round trip: tokens decode to the same docstring
        ids = dataset[i].tolist()
        assert ids[-1] == tokenizer.eod and tokenizer.eod not in ids[:-1]
        assert ids[:-1] == list(doc.encode("utf-8"))


@pytest.mark.integration
def test_corpus_is_cached_and_deterministic(corpus, tmp_path):
    again = build_corpus(corpus.parent.parent, max_bytes=SMALL)
    assert again == corpus and corpus == corpus_prefix(corpus.parent.parent, SMALL)
    other = build_corpus(tmp_path, max_bytes=SMALL)          # built afresh elsewhere
    for suffix in (".bin", ".idx"):
        assert other.with_suffix(suffix).read_bytes() == corpus.with_suffix(suffix).read_bytes()


@pytest.mark.integration
def test_global_batches_deterministic_and_identical_across_opens(corpus, tmp_path):
    options = DataOptions(seq_length=32, global_batch_size=6, num_iterations=4, seed=7,
                          data_path=[str(corpus)], data_dir=str(tmp_path))
    first = build_global_batches(options, vocab_size=512)
    second = build_global_batches(options, vocab_size=512)     # as another rank would
    assert len(first) >= 4
    batches = [first.batch(i).tensors() for i in range(4)]
    for i, batch in enumerate(batches):
        assert set(batch) == set(BATCH_KEYS)
        for key in BATCH_KEYS:
            assert batch[key].shape == (6, 32)
            assert torch.equal(batch[key], second.batch(i).tensors()[key])
            assert torch.equal(batch[key], first.batch(i).tensors()[key])
        # GPTDataset's contract: labels are the tokens shifted by one.
        assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
        assert batch["tokens"].max() < 256 and batch["loss_mask"].sum() > 0
        assert torch.equal(batch["position_ids"][0], torch.arange(32))
    assert not torch.equal(batches[0]["tokens"], batches[1]["tokens"])
    shuffled = build_global_batches(DataOptions(**{**options.__dict__, "seed": 8}), 512)
    assert not torch.equal(shuffled.batch(0).tensors()["tokens"], batches[0]["tokens"])


@pytest.mark.unit
def test_bad_data_path_and_vocab_are_config_errors(corpus, tmp_path):
    with pytest.raises(ConfigError, match="--data-path.*not found"):
        check_prefixes([str(tmp_path / "nope")], "--data-path", 512)
    with pytest.raises(ConfigError, match="vocab_size"):
        byte_tokenizer(100)
    assert int(np.max(np.fromfile(corpus.with_suffix(".bin"), dtype=np.uint16))) < 256


@pytest.mark.unit
def test_token_beyond_the_vocab_is_a_config_error_in_the_batches_that_read_it(tmp_path):
    """The check runs on what each global batch reads (no start-up scan of the .bin): exactly the
    batches holding the bad id fail, with the data path, the id and the vocab in the message."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "user" / "text_document"
    prefix.parent.mkdir()
    builder = IndexedDatasetBuilder(str(prefix.with_suffix(".bin")), dtype=np.uint16)
    rng = np.random.default_rng(0)
    for doc in range(40):
        ids = rng.integers(2, 256, size=50).astype(np.uint16)
        if doc == 17:
            ids[25] = 300                  # tokenized for a larger vocabulary than the model's
        builder.add_document(np.append(ids, 0).astype(np.uint16), [51])
    builder.finalize(str(prefix.with_suffix(".idx")))
    batches = build_global_batches(DataOptions(16, 4, 20, data_path=[str(prefix)],
                                               data_dir=str(tmp_path)), vocab_size=256)
    failed = []
    for i in range(len(batches)):
        rows = [batches.dataset[j] for j in range(4 * i, 4 * i + 4)]
        holds_bad_id = any(int(r[key].max()) == 300 for r in rows for key in ("tokens", "labels"))
        if not holds_bad_id:
            assert int(batches.batch(i).tensors()["tokens"].max()) < 256
            continue
        with pytest.raises(ConfigError) as info:
            batches.batch(i).tensors()
        assert str(info.value) == (
            f"<input>: field '--data-path': {prefix} holds token id 300 "
            f"(read by global batch {i}), beyond the model's vocab_size 256 "
            "(allowed: a dataset tokenized for this model's vocabulary)")
        failed.append(i)
    assert 1 <= len(failed) < len(batches)


# ---- each rank reads only the micro-batches it trains -----------------------------------------

class _CountingDataset:
    """The GPTDataset, recording which samples are read (the reads a rank materialises)."""

    def __init__(self, dataset):
        self.dataset, self.read = dataset, []

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        self.read.append(index)
        return self.dataset[index]


def _per_rank_plan():
    """Pipeline 0: two stages, 3 micro-batches; pipeline 1: one rank, 1 micro-batch (mbs 2)."""
    from pathlib import Path

    from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
    from megatron_autohet.spec.model import load_model

    model = load_model(Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny.yaml")
    return Plan(cluster="test", model=model, micro_batch_size=2, global_batch_size=8,
                seq_length=32, ranks=[RankInfo(r, "node", r, "GPU") for r in range(3)],
                pipelines=[Pipeline([Stage([0], (0, 3)), Stage([1], (3, 6))], 3),
                           Pipeline([Stage([2], (0, 6))], 1)]).validate()


_PER_RANK_OPTIMIZER = dict(lr=1e-3, lr_decay_style="constant")


def _train_reading(rank, world_size, batches, iters):
    from megatron_autohet.data.batches import GlobalBatches
    from megatron_autohet.runtime.optimizer import OptimizerSettings
    from megatron_autohet.runtime.trainer import HeteroTrainer

    plan = _per_rank_plan()
    counting = _CountingDataset(batches.dataset)
    mine = GlobalBatches(counting, batches.global_batch_size, batches.vocab_size,
                         batches.data_path)
    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=5,
                            optimizer=OptimizerSettings(**_PER_RANK_OPTIMIZER))
    losses = [trainer.train_step(mine.batch(i)).loss for i in range(iters)]
    return counting.read, losses


def _reference_losses(rank, world_size, tensors):
    from megatron_autohet.runtime.optimizer import OptimizerSettings
    from megatron_autohet.testing.reference import run_reference
    from megatron_autohet.runtime.stage_model import plan_padded_vocab_size

    plan = _per_rank_plan()
    steps = run_reference(plan.model, tensors, micro_batch_size=plan.micro_batch_size, seed=5,
                          optimizer=OptimizerSettings(**_PER_RANK_OPTIMIZER),
                          padded_vocab=plan_padded_vocab_size(plan))
    return [s.loss for s in steps]


@pytest.mark.integration
def test_each_rank_reads_only_its_micro_batches_and_trains_like_the_reference(corpus, tmp_path):
    """Rank r materialises exactly the samples of its pipeline's micro-batches of each global
    batch, once each, in order (pipeline 0's two stages rows 0-5, pipeline 1 rows 6-7); the losses
    equal the single-process reference trained on the whole batches."""
    from helpers.dist_utils import run_on_ranks
    from megatron_autohet.layout.topology import rank_role

    iters = 2
    plan = _per_rank_plan()
    batches = build_global_batches(DataOptions(32, 8, iters, data_path=[str(corpus)],
                                               data_dir=str(tmp_path)), vocab_size=512)
    out = run_on_ranks(3, _train_reading, batches, iters, timeout=180)
    for rank, (read, _) in enumerate(out):
        role = rank_role(plan, rank)
        first = role.microbatch_offset * plan.micro_batch_size
        rows = range(first, first + role.stage.num_microbatches * plan.micro_batch_size)
        assert read == [8 * i + row for i in range(iters) for row in rows], rank
    assert [len(read) for read, _ in out] == [2 * 6, 2 * 6, 2 * 2]
    reference = run_on_ranks(1, _reference_losses,
                             [batches.batch(i).tensors() for i in range(iters)])[0]
    for _, losses in out:
        assert losses == pytest.approx(reference, rel=1e-5)
