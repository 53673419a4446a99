"""Datasets: loaded from their source, checked, tokenized once (cached on disk) and batched.

Every loader returns :class:`RawData` with a ``text`` and an integer ``label`` column, so
tokenization, caching and batching are shared by all sources and both backends.
"""

from __future__ import annotations

import contextvars
import hashlib
import html
import io
import json
import logging
import random
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import ClassLabel, Dataset, DatasetDict, load_from_disk
from torch.utils.data import DataLoader, Sampler

from effitrain.config.errors import invalid
from effitrain.train.labels import check_label_kinds, check_label_sets
from effitrain.util.atomic import atomic_path, sha256
from effitrain.util.compat import dataset_fingerprint

log = logging.getLogger(__name__)

DRUG_REVIEW_LABELS = ["negative", "neutral", "positive"]
CACHE_FORMAT = 3  # bump when the tokenized layout changes, so stale caches are not reused


@dataclass
class RawData:
    train: Dataset
    eval: Dataset
    label_names: list[str]


def load_drug_reviews(path: str, num_labels: int = len(DRUG_REVIEW_LABELS)) -> RawData:
    """The UCI drug-review subset: TSV files inside a zip, labels negative/neutral/positive.

    ``num_labels``: the classes the config declares (what estimates read, without the data): 3."""
    import pandas as pd

    if num_labels != len(DRUG_REVIEW_LABELS):
        raise invalid(
            "data.num_labels", num_labels, f"the drug reviews have {len(DRUG_REVIEW_LABELS)} classes: give 3"
        )

    def read(member: str) -> Dataset:
        with zipfile.ZipFile(path) as archive:
            frame = pd.read_csv(io.BytesIO(archive.read(member)), sep="\t")
        # Reviews are quoted twice in the source ("""text""") and carry HTML entities (&#039;).
        texts = [html.unescape(str(t)).strip().strip('"').strip() for t in frame["review"]]
        labels = [DRUG_REVIEW_LABELS.index(r) for r in frame["rating"]]
        return Dataset.from_dict({"text": texts, "label": labels})

    return RawData(read("drugsComTrain.tsv"), read("drugsComTest.tsv"), list(DRUG_REVIEW_LABELS))


_FILLER = (
    "the a of and to in is was it for on with as at by this that from or be are have one all "
    "there when up out so about into time some could them see other than then now look only come "
    "its over think also back after use two how our work first well way even new want because"
).split()
_KEYWORDS = [
    ["good", "great", "happy"],
    ["bad", "awful", "sad"],
    ["blue", "green", "red"],
    ["dog", "cat", "horse"],
    ["north", "south", "east"],
    ["water", "fire", "earth"],
]


def load_synthetic(
    num_train: int, num_eval: int, num_labels: int, words_per_text: int, seed: int,
    min_words_per_text: int | None = None,
) -> RawData:  # fmt: skip
    """A learnable task made in code: each text holds one keyword of its class among filler words.
    ``min_words_per_text``: texts of lengths drawn between it and ``words_per_text`` (so batches
    hold different numbers of real tokens); None: every text has ``words_per_text`` words."""
    if not 2 <= num_labels <= len(_KEYWORDS):
        raise invalid("data.num_labels", num_labels, f"must be between 2 and {len(_KEYWORDS)}")
    if min_words_per_text is not None and not 1 <= min_words_per_text <= words_per_text:
        raise invalid(
            "data.min_words_per_text", min_words_per_text, f"must be between 1 and {words_per_text}"
        )

    def make(count: int, split_seed: int) -> Dataset:
        rng = random.Random(split_seed)
        texts, labels = [], []
        for _ in range(count):
            label = rng.randrange(num_labels)
            length = (
                words_per_text
                if min_words_per_text is None
                else rng.randint(min_words_per_text, words_per_text)
            )
            words = [rng.choice(_FILLER) for _ in range(length - 1)]
            words.insert(rng.randrange(length), rng.choice(_KEYWORDS[label]))
            texts.append(" ".join(words))
            labels.append(label)
        return Dataset.from_dict({"text": texts, "label": labels})

    names = [f"class_{i}" for i in range(num_labels)]
    return RawData(make(num_train, seed), make(num_eval, seed + 1), names)


def load_hub(
    load_args: dict, text_column: str, label_column: str | None, train_split: str, eval_split: str
) -> RawData:
    """Any ``datasets.load_dataset`` source (hub name or a builder over local files).

    ``label_column=None`` (a task that reads texts only, such as causal_lm): no labels are read,
    and the splits hold a ``text`` column alone.

    Raises:
        ConfigError: a split or column named in the config does not exist, or a label is missing.
    """
    from datasets import load_dataset
    from omegaconf import OmegaConf

    args = OmegaConf.to_container(load_args, resolve=True) if not isinstance(load_args, dict) else load_args
    from datasets.exceptions import DatasetGenerationError

    if _local_files(args.get("data_files")):
        # the datasets library keys its own cache of local files by path, size and modification time:
        # a file rewritten with the same three would be served from the old rows; read them anew
        args.setdefault("download_mode", "force_redownload")
    try:
        dataset = load_dataset(**args)
    except DatasetGenerationError as error:  # e.g. one file's label column holds text, another's numbers
        cause = error.__cause__ or error
        reason = " ".join(str(cause).split())[:300]
        raise invalid("data.load_args.data_files", "...",
                      f"the files do not read as one dataset ({type(cause).__name__}: {reason}): "
                      "give every split's columns the same kind of values") from None  # fmt: skip
    for key, split in (("data.train_split", train_split), ("data.eval_split", eval_split)):
        if split not in dataset:
            raise invalid(key, split, f"no such split: choose one of {', '.join(dataset)}")
    for key, column in (("data.text_column", text_column), ("data.label_column", label_column)):
        if column is not None and column not in dataset[train_split].column_names:
            raise invalid(
                key, column, f"no such column: choose one of {', '.join(dataset[train_split].column_names)}"
            )
    for split in (train_split, eval_split):
        for row, text in enumerate(dataset[split][text_column]):
            if text is None or (isinstance(text, float) and text != text):
                raise invalid(
                    f"data.text_column ({split} split, row {row + 2} of a CSV)", text_column,
                    "the text is empty: every sample needs one",
                )  # fmt: skip
    if label_column is None:
        return RawData(
            *(
                Dataset.from_dict({"text": [str(t) for t in dataset[s][text_column]]})
                for s in (train_split, eval_split)
            ),
            [],
        )

    for split in (train_split, eval_split):
        for row, value in enumerate(dataset[split][label_column]):
            if value is None or (isinstance(value, float) and value != value):
                raise invalid(
                    f"data.label_column ({split} split, row {row + 2} of a CSV)", value,
                    "a label is missing: every sample needs one",
                )  # fmt: skip
    feature = dataset[train_split].features[label_column]
    train_labels, eval_labels = dataset[train_split][label_column], dataset[eval_split][label_column]
    check_label_kinds(label_column, set(train_labels) | set(eval_labels))
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        to_id = None
    else:
        values = sorted(
            set(dataset[train_split][label_column]) | set(dataset[eval_split][label_column]), key=str
        )
        whole_floats = all(isinstance(v, float) for v in values)  # class ids read as floats: 0.0, 1.0
        if whole_floats:
            values = sorted({int(v) for v in values})
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):  # True/False: two names
            # integer labels are class ids: a gap means a typo (one stray 100000 would build a
            # 100001-class head), not classes nobody labelled
            unused = sorted(set(range(max(values) + 1)) - set(values))
            if unused or min(values) < 0:
                shown = ", ".join(map(str, unused[:5])) + (", ..." if len(unused) > 5 else "")
                raise invalid(
                    "data.label_column", label_column,
                    f"integer labels must be the class ids 0..{max(values)} with none unused "
                    f"(unused: {shown or 'none'}; smallest: {min(values)})",
                )  # fmt: skip
            names = [str(i) for i in range(max(values) + 1)]
            to_id = {float(v): v for v in values} if whole_floats else None
        else:
            names = [str(v) for v in values]
            to_id = {v: i for i, v in enumerate(values)}

    check_label_sets(label_column, train_labels, eval_labels)

    def standardize(split: str) -> Dataset:
        part = dataset[split]
        texts = part[text_column]
        labels = part[label_column] if to_id is None else [to_id[v] for v in part[label_column]]
        return Dataset.from_dict({"text": [str(t) for t in texts], "label": list(labels)})

    return RawData(standardize(train_split), standardize(eval_split), names)


def _local_files(data_files) -> bool:
    """``data_files`` names files, and all of them on this machine (no ``scheme://``)."""
    if not data_files:
        return False
    if isinstance(data_files, dict):
        data_files = list(data_files.values())
    if isinstance(data_files, str):
        data_files = [data_files]
    flat = [f for item in data_files for f in ([item] if isinstance(item, str) else item)]
    return all("://" not in str(f) for f in flat)


def check_raw(raw: RawData, num_labels: int) -> None:
    """Raises ConfigError for an empty split or labels outside the model's classes."""
    for split, part in (("train", raw.train), ("eval", raw.eval)):
        if len(part) == 0:
            raise invalid(f"data ({split} split)", 0, "the split is empty: it needs at least one sample")
        labels = part["label"]
        bad = [label for label in labels if not 0 <= label < num_labels]
        if bad:
            raise invalid(f"data ({split} split) label", bad[0], f"labels must be in 0..{num_labels - 1}")


# The tokenized cache's key while tokenize_cached runs a task's tokenize (map_splits reads it)
_TOKENIZED_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("tokenized_key", default=None)


def map_splits(splits: dict, encode, remove_columns: list[str]) -> DatasetDict:
    """``DatasetDict(splits).map(encode, batched=True, remove_columns=...)``, as a task's ``tokenize``
    maps its splits. Inside :func:`tokenize_cached` each split's new fingerprint is the cache's key
    and the split's name: the key names everything the result depends on, where datasets would hash
    ``encode`` and the tokenizer it holds (two thirds of a second, against milliseconds of work)."""
    key = _TOKENIZED_KEY.get()
    return DatasetDict(
        {
            name: split.map(encode, batched=True, remove_columns=remove_columns, desc="tokenizing",
                            new_fingerprint=None if key is None else f"{key}-{name}")  # fmt: skip
            for name, split in splits.items()
        }
    )


def tokenize_cached(
    raw: RawData, tokenizer, max_length: int, cache_dir: str | None, source_key: dict, task
) -> DatasetDict:
    """Tokenize both splits once, as ``task`` (:class:`effitrain.train.tasks.Task`) does; later runs with
    the same data, tokenizer, length and task load the cache.

    The cache key is a hash of the data config, the data read, the tokenizer's files, ``max_length``
    and the task's own keys (packing); a cache entry is written to a temporary folder and renamed,
    so an interrupted run never leaves half a cache.
    """
    key_material = json.dumps(
        {
            "format": CACHE_FORMAT,
            "source": source_key,
            # what was read, not where from: files rewritten at the same path give another key
            "data": [dataset_fingerprint(raw.train), dataset_fingerprint(raw.eval)],
            "tokenizer": tokenizer.name_or_path,
            "tokenizer_class": type(tokenizer).__name__,
            "tokenizer_files": _tokenizer_digest(tokenizer),
            "max_length": max_length,
            "task": task.cache_key(),
        },
        sort_keys=True,
        default=str,
    )
    key = hashlib.sha256(key_material.encode()).hexdigest()[:20]
    target = Path(cache_dir).expanduser() / key if cache_dir else None
    if target is not None and target.exists():
        damage = _cache_damage(target)
        if damage is None:
            try:
                return load_from_disk(str(target))
            except Exception as error:  # a damaged entry is rebuilt, never a dead end for this config
                damage = f"unreadable ({type(error).__name__})"
        log.warning("tokenized cache %s %s: rebuilding it", target, damage)
        print(
            f"effitrain: warning: tokenized cache {target} {damage}: rebuilding it",
            file=sys.stderr,
            flush=True,
        )
        shutil.rmtree(target, ignore_errors=True)

    given = _TOKENIZED_KEY.set(key)
    try:
        tokenized = task.tokenize(raw, tokenizer, max_length)
    finally:
        _TOKENIZED_KEY.reset(given)
    if target is None:
        return tokenized
    try:
        with atomic_path(target) as partial:  # removed if anything fails; never replaces another's entry
            tokenized.save_to_disk(str(partial))
            manifest = {
                str(p.relative_to(partial)): sha256(p) for p in sorted(partial.rglob("*")) if p.is_file()
            }
            (partial / CACHE_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    except OSError as error:
        if not target.exists():  # not written (a full disk): train from memory, say so once
            print(
                f"effitrain: warning: the tokenized data could not be cached in {target.parent} "
                f"({error.strerror or type(error).__name__}); continuing without the cache",
                file=sys.stderr,
                flush=True,
            )
            return tokenized
    return load_from_disk(str(target))


CACHE_MANIFEST = "effitrain-sha256.json"  # every file of a cache entry with its SHA-256


def _cache_damage(entry: Path) -> str | None:
    """Why a tokenized cache entry may not be used (a file missing, added or with other bytes than
    its manifest lists, as checkpoints are verified), or None when it is whole."""
    try:
        manifest = json.loads((entry / CACHE_MANIFEST).read_text())
    except (OSError, ValueError):
        return "has no readable checksum list"
    files = {str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file()} - {CACHE_MANIFEST}
    if files != set(manifest):
        return "does not hold the files its checksum list names"
    for name, expected in sorted(manifest.items()):
        if sha256(entry / name) != expected:
            return f"has other bytes than written in {name}"
    return None


def _tokenizer_digest(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary and rules: a retrained tokenizer at the same path differs."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class EpochPermutationSampler(Sampler[int]):
    """A fresh permutation per epoch from ``seed + epoch``: both backends see the same order.

    Not accelerate's ``SeedableRandomSampler`` (the same ``torch.randperm``): as a ``RandomSampler``
    it is re-made by the Trainer's ``accelerator.prepare`` (``use_seedable_sampler``), and it moves
    itself to the next epoch after every full pass, so the order would depend on accelerate's
    internals rather than on ``seed`` and ``set_epoch`` alone (tried: a test reading epoch 0's
    batches after training saw epoch 1's)."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_samples


def build_dataloaders(
    tokenized: DatasetDict, collate, micro_batch_size: int, eval_batch_size: int, seed: int
):
    """Train loader (seeded per-epoch permutation, the task's collation: dynamic padding) and eval
    loader (in order)."""
    tokenized = tokenized.with_format("torch")
    sampler = EpochPermutationSampler(len(tokenized["train"]), seed)
    train = DataLoader(tokenized["train"], batch_size=micro_batch_size, sampler=sampler, collate_fn=collate)
    evaluation = DataLoader(tokenized["eval"], batch_size=eval_batch_size, shuffle=False, collate_fn=collate)
    return train, evaluation, sampler
