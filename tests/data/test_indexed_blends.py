"""Megatron-LM's dataset flags: prefixes checked before any process (data/indexed.py), blends and
per-split blends read through megatron-core's BlendedMegatronDatasetBuilder (data/batches.py)."""

import numpy as np
import pytest

from megatron_autohet.data.batches import DataOptions, build_global_batches, build_splits
from megatron_autohet.data.indexed import check_prefixes
from megatron_autohet.errors import ConfigError


def _dataset(prefix, token: int, docs: int = 40, length: int = 50, dtype=np.uint16):
    """An indexed dataset of ``docs`` documents of ``token`` repeated (EOD 0 after each)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix.with_suffix(".bin")), dtype=dtype)
    for _ in range(docs):
        builder.add_document(np.append(np.full(length, token), 0).astype(dtype), [length + 1])
    builder.finalize(str(prefix.with_suffix(".idx")))
    return str(prefix)


def _refused(paths, vocab_size=512, flag="--data-path"):
    with pytest.raises(ConfigError) as info:
        check_prefixes(paths, flag, vocab_size)
    return str(info.value)


@pytest.mark.integration
def test_prefix_mistakes_are_named_before_any_process(tmp_path):
    good = _dataset(tmp_path / "a" / "text", 5)
    check_prefixes([good], "--data-path", 512)
    check_prefixes(["0.3", good, "0.7", good], "--data-path", 512)
    assert _refused([good + ".bin"]) == (
        f"<command line>: field '--data-path': {good}.bin ends in .bin (allowed: give the prefix "
        f"without .bin: {good})")
    assert "ends in .idx" in _refused([good + ".idx"], flag="--train-data-path")
    assert _refused(["0.5", good, "0.5", str(tmp_path / "missing")]) == (
        f"<command line>: field '--data-path': {tmp_path / 'missing'}.bin not found (allowed: "
        "the prefix of a megatron indexed dataset (PREFIX.bin + PREFIX.idx))")
    assert "weight '-1'" in _refused(["-1", good, "2", good])
    # a .bin of another tokenization next to this .idx
    other = _dataset(tmp_path / "b" / "text", 5, docs=30)
    (tmp_path / "b" / "text.idx").write_bytes((tmp_path / "a" / "text.idx").read_bytes())
    message = _refused([other])
    assert f"{other}.bin holds {30 * 51 * 2} bytes but {other}.idx indexes {40 * 51 * 2}" \
        in message, message
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "text.bin").write_bytes(b"")
    (tmp_path / "c" / "text.idx").write_bytes(b"not an index")
    assert "is not a megatron index" in _refused([str(tmp_path / "c" / "text")])
    # tokens of uint8 hold ids up to 255: written for a smaller vocabulary than 512
    small = _dataset(tmp_path / "d" / "text", 5, dtype=np.uint8)
    assert _refused([small]) == (
        f"<command line>: field '--data-path': {small}.idx's tokens are uint8, which holds ids "
        "up to 255; the model's vocab_size is 512 (allowed: a dataset tokenized for this "
        "model's vocabulary (Megatron-LM's preprocess_data.py writes uint16 below 65500 tokens, "
        "int32 above))")
    check_prefixes([small], "--data-path", 256)


def _first_tokens(rank, world_size, options: DataOptions, batches: int) -> dict:
    """Every row's first token of the training batches and of two validation batches, built in
    a process group (megatron-core's BlendedDataset builds its index on global rank 0)."""
    train, valid = build_splits(options, 512)
    return {"train": [train.batch(i).tensors()["tokens"][:, 0].tolist() for i in range(batches)],
            "valid": valid and [valid.batch(i).tensors()["tokens"][:, 0].tolist()
                                for i in range(2)]}


def _read(options: DataOptions, batches: int = 10) -> dict:
    from helpers.dist_utils import run_on_ranks

    return run_on_ranks(1, _first_tokens, options, batches, timeout=300)[0]


@pytest.mark.integration
def test_a_weighted_blend_draws_each_dataset_at_its_weight(tmp_path):
    """megatron-core's BlendedDataset: a blend of one dataset is that dataset's batches; 0.25 A
    0.75 B gives A's rows a quarter of the samples."""
    a = _dataset(tmp_path / "a" / "text", 5)
    b = _dataset(tmp_path / "b" / "text", 7)
    cache = str(tmp_path / "cache")
    plain = build_global_batches(DataOptions(16, 8, 10, data_path=[a], data_dir=cache), 512)
    assert _read(DataOptions(16, 8, 10, data_path=["1", a], data_dir=cache))["train"] == [
        plain.batch(i).tensors()["tokens"][:, 0].tolist() for i in range(10)]
    firsts = sum(_read(DataOptions(16, 8, 10, data_path=["0.25", a, "0.75", b],
                                   data_dir=cache))["train"], [])
    assert len(firsts) == 80 and set(firsts) <= {0, 5, 7}
    # a row starting at an EOD (0) is from either; the others name their dataset
    assert sum(t == 5 for t in firsts) == pytest.approx(0.25 * sum(t != 0 for t in firsts),
                                                       abs=3)


@pytest.mark.integration
def test_per_split_blends_and_a_split_blend_validate_on_their_documents(tmp_path):
    train = _dataset(tmp_path / "t" / "text", 5)
    valid = _dataset(tmp_path / "v" / "text", 9)
    per_split = _read(DataOptions(16, 4, 5, train_data_path=[train], valid_data_path=[valid],
                                  valid_batches=2, data_dir=str(tmp_path / "cache")), 5)
    assert set(sum(per_split["train"], [])) <= {0, 5}
    assert set(sum(per_split["valid"], [])) <= {0, 9} and 9 in sum(per_split["valid"], [])
    cut = _read(DataOptions(16, 4, 5, data_path=["0.5", train, "0.5", valid], split="90,8,2",
                            valid_batches=2, data_dir=str(tmp_path / "cache")), 5)
    assert {5, 9} <= set(sum(cut["train"], [])) and len(cut["valid"]) == 2
