"""Built-in corpus -> megatron indexed dataset -> GPTDataset -> global batches."""

import numpy as np
import pytest
import torch

from megatron_autohet.data.batches import BATCH_KEYS, DataOptions, build_global_batches
from megatron_autohet.data.corpus import (build_corpus, byte_tokenizer, corpus_prefix,
                                          stdlib_documents)
from megatron_autohet.errors import ConfigError

SMALL = 64 * 1024           # corpus budget for the tests: a few hundred documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("data"), max_bytes=SMALL)


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


def test_corpus_is_cached_and_deterministic(corpus, tmp_path):
    again = build_corpus(corpus.parent.parent, max_bytes=SMALL)
    assert again == corpus and corpus == corpus_prefix(corpus.parent.parent, SMALL)
    other = build_corpus(tmp_path, max_bytes=SMALL)          # built afresh elsewhere
    for suffix in (".bin", ".idx"):
        assert other.with_suffix(suffix).read_bytes() == corpus.with_suffix(suffix).read_bytes()


def test_global_batches_deterministic_and_identical_across_opens(corpus, tmp_path):
    options = DataOptions(seq_length=32, global_batch_size=6, num_iterations=4, seed=7,
                          data_path=str(corpus), data_dir=str(tmp_path))
    first = build_global_batches(options, vocab_size=512)
    second = build_global_batches(options, vocab_size=512)     # as another rank would
    assert len(first) >= 4
    batches = [first.batch(i) for i in range(4)]
    for i, batch in enumerate(batches):
        assert set(batch) == set(BATCH_KEYS)
        for key in BATCH_KEYS:
            assert batch[key].shape == (6, 32)
            assert torch.equal(batch[key], second.batch(i)[key])
            assert torch.equal(batch[key], first.batch(i)[key])
        # GPTDataset's contract: labels are the tokens shifted by one.
        assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
        assert batch["tokens"].max() < 256 and batch["loss_mask"].sum() > 0
        assert torch.equal(batch["position_ids"][0], torch.arange(32))
    assert not torch.equal(batches[0]["tokens"], batches[1]["tokens"])
    shuffled = build_global_batches(DataOptions(**{**options.__dict__, "seed": 8}), 512)
    assert not torch.equal(shuffled.batch(0)["tokens"], batches[0]["tokens"])


def test_bad_data_path_and_vocab_are_config_errors(corpus, tmp_path):
    with pytest.raises(ConfigError, match="--data-path.*not found"):
        build_global_batches(DataOptions(32, 4, 1, data_path=str(tmp_path / "nope"),
                                         data_dir=str(tmp_path)), 512)
    with pytest.raises(ConfigError, match="vocab_size"):
        byte_tokenizer(100)
    assert int(np.max(np.fromfile(corpus.with_suffix(".bin"), dtype=np.uint16))) < 256


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
    batches = build_global_batches(DataOptions(16, 4, 20, data_path=str(prefix),
                                               data_dir=str(tmp_path)), vocab_size=256)
    failed = []
    for i in range(len(batches)):
        rows = [batches.dataset[j] for j in range(4 * i, 4 * i + 4)]
        holds_bad_id = any(int(r[key].max()) == 300 for r in rows for key in ("tokens", "labels"))
        if not holds_bad_id:
            assert int(batches.batch(i)["tokens"].max()) < 256
            continue
        with pytest.raises(ConfigError) as info:
            batches.batch(i)
        assert str(info.value) == (
            f"<input>: field '--data-path': {prefix} holds token id 300 (read by global batch {i}), "
            "beyond the model's vocab_size 256 (allowed: a dataset tokenized for this model's "
            "vocabulary)")
        failed.append(i)
    assert 1 <= len(failed) < len(batches)
