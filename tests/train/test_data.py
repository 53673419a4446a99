"""Datasets: what is cached is what was read; bad labels are refused; the cache survives damage."""

from __future__ import annotations

import errno

import pytest
import torch
from hydra.utils import instantiate

from effitrain.config.errors import ConfigError, instantiate_node
from effitrain.train.data import tokenize_cached
from effitrain.train.modeling import build_tokenizer
from effitrain.train.tasks import Classification, macro_f1
from tests.helpers.run import compose, run_job


def hub(folder, *extra):
    return [
        "data=hub",
        "data.load_args.path=csv",
        f"+data.load_args.data_files={{train: {folder}/train.csv, test: {folder}/test.csv}}",
        *extra,
    ]


def write_csv(path, rows):
    path.write_text("text,label\n" + "".join(f"{text},{label}\n" for text, label in rows))


@pytest.mark.slow
def test_files_rewritten_at_the_same_path_are_tokenized_anew(tmp_path):
    write_csv(tmp_path / "train.csv", [("good", 1), ("bad", 0)] * 4)
    write_csv(tmp_path / "test.csv", [("fine", 1), ("awful", 0)])
    first = run_job(tmp_path / "first", *hub(tmp_path), "max_steps=1")
    assert first["status"] == "ok" and first["eval/samples"] == 2
    write_csv(tmp_path / "test.csv", [("fine", 1), ("awful", 0), ("okay", 1)])  # same path, other rows
    second = run_job(tmp_path / "second", *hub(tmp_path), "max_steps=1")
    assert second["status"] == "ok" and second["eval/samples"] == 3


def _tokenize(tmp_path, cache):
    cfg = compose()
    return tokenize_cached(
        instantiate(cfg.data), build_tokenizer(cfg.model), 16, str(cache), {"k": 1}, Classification()
    )


def test_the_cache_is_reused_and_a_damaged_entry_rebuilt(tmp_path):
    cache = tmp_path / "cache"
    fresh = _tokenize(tmp_path, cache)["train"]["input_ids"]
    [entry] = list(cache.iterdir())
    again = _tokenize(tmp_path, cache)["train"]
    assert again["input_ids"] == fresh
    assert all(f["filename"].startswith(str(entry)) for f in again.cache_files)  # read from the cache
    for path in entry.rglob("*.arrow"):  # a new file in its place: loaded datasets keep their mapping
        path.unlink()
        path.write_bytes(b"not arrow")
    assert _tokenize(tmp_path, cache)["train"]["input_ids"] == fresh
    assert [p.name for p in cache.iterdir()] == [entry.name]


def test_a_full_disk_while_caching_leaves_no_partial_folder(tmp_path, monkeypatch, capsys):
    from datasets import DatasetDict

    def full(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DatasetDict, "save_to_disk", full)
    cache = tmp_path / "cache"
    cache.mkdir()
    tokenized = _tokenize(tmp_path, cache)
    assert len(tokenized["train"]) == 256 and list(cache.iterdir()) == []
    assert "could not be cached" in capsys.readouterr().err


@pytest.mark.parametrize(
    "train, message",
    [
        ([("good", 1), ("bad", "")], "data.label_column (train split, row 3 of a CSV)=None is invalid: a label is missing"),
        ([("good", 1), ("bad", 100000)], "data.label_column='label' is invalid: integer labels must be the class ids 0..100000"),
    ],
)  # fmt: skip
def test_missing_and_sparse_labels_are_refused(tmp_path, train, message):
    write_csv(tmp_path / "train.csv", train)
    write_csv(tmp_path / "test.csv", [("fine", 1), ("awful", 0)])
    with pytest.raises(ConfigError) as error:
        instantiate_node(compose(*hub(tmp_path)).data)
    assert str(error.value).startswith(message)


def test_a_true_false_label_column_is_two_named_classes(tmp_path):
    """pandas reads True/False as booleans, which are ints to Python: they were taken for class ids
    and reached the loss as a bool tensor."""
    write_csv(tmp_path / "train.csv", [("good", True), ("bad", False), ("fine", True)])
    write_csv(tmp_path / "test.csv", [("okay", True), ("awful", False)])
    raw = instantiate_node(compose(*hub(tmp_path)).data)
    assert raw.label_names == ["False", "True"]
    train, eval_ = list(raw.train["label"]), list(raw.eval["label"])
    assert train == [1, 0, 1] and eval_ == [1, 0]
    assert all(type(label) is int for label in train + eval_)  # not bools: the loss takes class ids


def test_macro_f1_equals_scikit_learn():
    from sklearn.metrics import f1_score

    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (200,), generator=generator)
    predictions = torch.where(torch.rand(200, generator=generator) < 0.6, labels, torch.randint(0, 3, (200,)))
    expected = f1_score(labels.numpy(), predictions.numpy(), average="macro")
    assert macro_f1(predictions, labels, 4) == pytest.approx(expected, abs=1e-12)


def test_a_file_rewritten_with_the_same_size_and_time_is_read_anew(tmp_path):
    """The datasets library's own cache keys local files by path, size and modification time: a
    rewrite that keeps all three must still give the new rows (and their tokens)."""
    import os

    from effitrain.train.tasks import Classification

    write_csv(tmp_path / "train.csv", [("good", 1), ("bad", 0)] * 2)
    write_csv(tmp_path / "test.csv", [("fine", 1), ("vile", 0)])
    cfg = compose(*hub(tmp_path))
    first = Classification().load(cfg.data)
    stat = os.stat(tmp_path / "test.csv")
    write_csv(tmp_path / "test.csv", [("nice", 1), ("grim", 0)])  # same size
    os.utime(tmp_path / "test.csv", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(tmp_path / "test.csv").st_size == stat.st_size
    second = Classification().load(cfg.data)
    assert first.eval["text"] == ["fine", "vile"] and second.eval["text"] == ["nice", "grim"]
    tokenizer = build_tokenizer(cfg.model)
    tokens = tokenize_cached(second, tokenizer, 16, str(tmp_path / "cache"), {"k": 1}, Classification())
    assert tokens["eval"]["input_ids"] == [tokenizer(t)["input_ids"] for t in ("nice", "grim")]


def test_a_cache_entry_with_altered_bytes_is_rebuilt(tmp_path, capsys):
    """A cache entry whose bytes changed but still reads as a dataset (one token id rewritten in
    place) is found by its checksums, as a checkpoint is, and rebuilt."""
    from datasets import Dataset

    cache = tmp_path / "cache"
    fresh = [list(row) for row in _tokenize(tmp_path, cache)["train"]["input_ids"]]  # copied out of the file
    [entry] = list(cache.iterdir())
    [arrow] = [p for p in entry.rglob("*.arrow") if "train" in str(p)]
    data = arrow.read_bytes()
    cls = (fresh[0][0]).to_bytes(4, "little")  # [CLS], the first token of every row
    arrow.write_bytes(data.replace(cls, (fresh[0][0] + 1).to_bytes(4, "little"), 1))
    altered = [list(row) for row in Dataset.from_file(str(arrow))["input_ids"]]
    assert altered != fresh and len(altered) == len(fresh)  # readable, and wrong
    assert [list(row) for row in _tokenize(tmp_path, cache)["train"]["input_ids"]] == fresh
    assert "has other bytes than written in" in capsys.readouterr().err
    assert [p.name for p in cache.iterdir()] == [entry.name]


def test_check_allows_exactly_the_synthetic_classes_the_loader_makes():
    from effitrain.config.schema import SYNTHETIC_MAX_LABELS
    from effitrain.train import data

    assert SYNTHETIC_MAX_LABELS == len(data._KEYWORDS) == 6
    raw = data.load_synthetic(num_train=12, num_eval=6, num_labels=6, words_per_text=4, seed=0)
    assert sorted(set(raw.train["label"])) == [0, 1, 2, 3, 4, 5]


def test_each_epoch_is_its_own_permutation_of_seed_plus_epoch():
    """The sampler's order, against torch.randperm seeded here with seed + epoch: every sample once
    per epoch, a new order each epoch, the same order again for the same epoch."""
    from effitrain.train.data import EpochPermutationSampler

    sampler = EpochPermutationSampler(58, seed=42)
    orders = []
    for epoch in (0, 1, 2, 1):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
        expected = torch.randperm(58, generator=torch.Generator().manual_seed(42 + epoch)).tolist()
        assert orders[-1] == expected and sorted(orders[-1]) == list(range(58))
    assert orders[0] != orders[1] != orders[2] and orders[3] == orders[1]


def test_tokenizing_for_the_cache_hashes_no_mapped_function(tmp_path, monkeypatch):
    """datasets names a mapped split by hashing the mapped function and the tokenizer it holds (two
    thirds of a second); inside tokenize_cached the cache's own key names it instead, and the rows
    are those of the tokenizer called on each text."""
    import datasets.fingerprint

    original = datasets.fingerprint.update_fingerprint

    def hashed(fingerprint, transform, transform_args):
        assert "function" not in transform_args, "the mapped function was hashed"
        return original(fingerprint, transform, transform_args)

    monkeypatch.setattr(datasets.fingerprint, "update_fingerprint", hashed)
    monkeypatch.setattr(datasets.arrow_dataset, "update_fingerprint", hashed)  # map's own name for it
    cfg = compose()
    raw, tokenizer = instantiate(cfg.data), build_tokenizer(cfg.model)
    tokens = tokenize_cached(raw, tokenizer, 16, None, {"k": 1}, Classification())  # no cache folder
    assert tokens["eval"]["input_ids"] == [
        tokenizer(text, truncation=True, max_length=16)["input_ids"] for text in raw.eval["text"]
    ]
