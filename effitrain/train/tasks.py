"""Tasks: what a model learns from the data. The ``task`` config group targets a class here.

A task decides the model class, how texts become batches, the loss, what normalizes the loss of an
optimizer step and the evaluation metrics. Backends call only these hooks (``job.task.loss_sum``,
``job.task.num_items``, ``job.task.evaluate``) and never branch on the task:

* :class:`Classification`: a sequence-classification head; the step's loss is the mean over its
  samples; eval/loss, eval/accuracy, eval/f1 (macro).
* :class:`CausalLM`: a decoder predicting each next token; the step's loss is the mean over the
  real target tokens of all its micro-batches and processes (padding never counts); eval/loss (the
  token mean over the eval split) and eval/perplexity = exp(eval/loss).

A task declares the metrics it writes beside eval/loss once (``Task.metrics``; effitrain's own in
:data:`effitrain.config.summary_schema.TASK_METRICS`, which compare's tables and verdict read
without importing torch); the run's closing line reads them from the task.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from effitrain.config.errors import instantiate_node, invalid
from effitrain.config.summary_schema import TASK_METRICS, Metric  # Metric: a task's own metrics
from effitrain.config.targets import READ_BY_EFFITRAIN

IGNORE_INDEX = -100  # the label cross-entropy skips: padding, and no target after a sequence's end


def model_inputs(batch) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def data_node(data_cfg: DictConfig, **values) -> DictConfig:
    """``data_cfg`` without the task's own keys (``packing``), with ``values`` set where the loader
    has such a parameter: what ``instantiate`` is given."""
    node = OmegaConf.to_container(data_cfg, resolve=True)
    for key in READ_BY_EFFITRAIN["data"]:
        node.pop(key, None)
    node.update({k: v for k, v in values.items() if k in node})
    return OmegaConf.create(node)


class Task:
    """The hooks shared code and backends call; see the module's docstring."""

    name = ""
    auto_class = ""  # the transformers Auto class that builds the model
    model_mapping = ""  # its model types: a mapping in transformers.models.auto.modeling_auto
    uses_labels = True  # whether the data's label column is read
    metrics: tuple[Metric, ...] = ()  # what evaluate and data_summary write beside eval/loss

    def load(self, data_cfg: DictConfig):
        """The raw data (:class:`effitrain.train.data.RawData`) from the ``data`` node; ConfigError for bad data."""
        return instantiate_node(data_node(data_cfg))

    def cache_key(self) -> dict:
        """What, besides the data and the tokenizer, decides the tokenized cache's content."""
        return {"task": self.name}

    def build_model(
        self, model_cfg: DictConfig, raw, tokenizer, device: str | None = None, quantization=None
    ):
        from effitrain.train.modeling import build_model

        num_labels = len(raw.label_names) if self.uses_labels else None
        return build_model(model_cfg, num_labels, tokenizer, device, self.auto_class, quantization)

    def labels_shape(self, rows: int, length: int) -> tuple:
        """The shape of a micro-batch's labels (``rows`` x ``length`` tokens): for memory estimates."""
        return (rows,)

    def num_tokens(self, batch):
        """Tokens a micro-batch trains on, for ``train/tokens`` (a tensor: read once per step)."""
        return self.num_items(batch)

    def data_summary(self, raw, tokenized) -> dict:
        """Summary keys describing the data, read and tokenized (none by default)."""
        return {}


class Classification(Task):
    """Sequence classification with a ``len(label_names)``-way head."""

    name = "classification"
    auto_class = "AutoModelForSequenceClassification"
    model_mapping = "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"  # model types that have the head
    metrics = TASK_METRICS["classification"]

    def load(self, data_cfg):
        from effitrain.train.data import check_raw
        from effitrain.train.labels import check_label_sets

        raw = super().load(data_cfg)
        check_raw(raw, len(raw.label_names))
        # every source, not only data=hub's columns: data made in code may be too small to hold
        # each class (data.num_train=1)
        key = "data.num_train" if "num_train" in data_cfg else "data.label_column"
        value = data_cfg.num_train if "num_train" in data_cfg else data_cfg.get("label_column", "label")
        check_label_sets(value, raw.train["label"], raw.eval["label"], key=key)
        return raw

    def data_summary(self, raw, tokenized) -> dict:
        """``eval/input_blind_loss``: the eval loss of a prediction that ignores the text (the training
        labels' prior, or uniform), which ``eval/loss`` must beat for the run to have learned."""
        from effitrain.train.labels import input_blind_loss

        loss = input_blind_loss(raw.train["label"], raw.eval["label"], len(raw.label_names))
        return {"eval/input_blind_loss": loss}

    def tokenize(self, raw, tokenizer, max_length: int):
        from effitrain.train.data import map_splits

        def encode(batch):
            return tokenizer(batch["text"], truncation=True, max_length=max_length)

        tokenized = map_splits({"train": raw.train, "eval": raw.eval}, encode, ["text"])
        return tokenized.rename_column("label", "labels")

    def collator(self, tokenizer):
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(tokenizer, return_tensors="pt")

    def build_model(self, model_cfg, raw, tokenizer, device=None, quantization=None):
        model = super().build_model(model_cfg, raw, tokenizer, device, quantization)
        model.config.id2label = dict(enumerate(raw.label_names))
        model.config.label2id = {name: i for i, name in enumerate(raw.label_names)}
        return model

    def loss_sum(self, model, batch) -> torch.Tensor:
        """Summed cross-entropy of a micro-batch; the caller divides by the step's samples
        (:meth:`num_items`), so a step's loss is the mean over all its samples, as one big batch."""
        logits = model(**model_inputs(batch)).logits
        return F.cross_entropy(logits.float(), batch["labels"], reduction="sum")

    def num_items(self, batch) -> int:
        return len(batch["labels"])

    def num_tokens(self, batch):
        mask = batch.get("attention_mask")
        return mask.sum() if mask is not None else batch["input_ids"].numel()

    @torch.no_grad()
    def evaluate(self, model, dataloader, accelerator) -> dict:
        """Loss, accuracy and macro F1 on the eval split, gathered over processes without duplicates."""
        was_training = model.training
        model.eval()
        losses, predictions, labels = [], [], []
        for batch in dataloader:
            logits = model(**model_inputs(batch)).logits.float()
            num_classes = logits.shape[-1]
            per_sample = F.cross_entropy(logits, batch["labels"], reduction="none")
            gathered = accelerator.gather_for_metrics((per_sample, logits.argmax(-1), batch["labels"]))
            for store, value in zip((losses, predictions, labels), gathered):
                store.append(value.cpu())
        model.train(was_training)
        losses, predictions, labels = torch.cat(losses), torch.cat(predictions), torch.cat(labels)
        return {
            "eval/loss": losses.mean().item(),
            "eval/accuracy": (predictions == labels).float().mean().item(),
            "eval/f1": macro_f1(predictions, labels, num_classes),
            "eval/samples": len(labels),
            # the eval split's sampling error of eval/loss: what compare calls noise with one seed
            "eval/loss_sem": (losses.std() / math.sqrt(len(losses))).item() if len(losses) > 1 else None,
        }


class CausalLM(Task):
    """Next-token prediction with a decoder (``AutoModelForCausalLM``).

    Each document is the tokenizer's encoding (with its beginning-of-text token, where it has one)
    followed by an end-of-text token. ``packing=false``: one document per row, truncated to
    ``max_length`` and padded per batch, labels -100 on padding. ``packing=true``: all documents of
    a split concatenated and cut into rows of exactly ``max_length`` tokens (the remainder dropped),
    so no compute goes to padding. Labels are the input ids; the model's prediction at position i
    is scored against label i + 1.
    """

    name = "causal_lm"
    auto_class = "AutoModelForCausalLM"
    model_mapping = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
    uses_labels = False
    metrics = TASK_METRICS["causal_lm"]  # eval/perplexity; train/unigram_perplexity, what it must beat

    def __init__(self, packing: bool = False):
        if not isinstance(packing, bool):
            raise invalid("data.packing", packing, "must be true or false")
        self.packing = packing
        self.loss_chunks = 1  # loss_chunks (build_task sets it): the head and loss over N chunks of positions

    def load(self, data_cfg):
        raw = instantiate_node(data_node(data_cfg, label_column=None))  # texts only: labels unread
        for split, part in (("train", raw.train), ("eval", raw.eval)):
            if len(part) == 0:
                raise invalid(f"data ({split} split)", 0, "the split is empty: it needs at least one sample")
        return raw

    def cache_key(self) -> dict:
        return {"task": self.name, "packing": self.packing}

    def build_model(self, model_cfg, raw, tokenizer, device=None, quantization=None):
        """The decoder (encoder types built with ``is_decoder=True``); refused when the built model
        still lets a position see later tokens (``validate`` checks a miniature of it up front)."""
        from effitrain.config.causality import sees_later_tokens
        from effitrain.config.targets import not_causal

        model = super().build_model(model_cfg, raw, tokenizer, device, quantization)
        if device != "meta" and sees_later_tokens(model):
            raise not_causal(model_cfg.get("name_or_path"), type(model).__name__)
        return model

    def tokenize(self, raw, tokenizer, max_length: int):
        from datasets import Dataset, DatasetDict

        eos = end_of_text_id(tokenizer)

        def documents(texts):
            ids = tokenizer(list(texts))["input_ids"]
            return [row if row and row[-1] == eos else [*row, eos] for row in ids]

        def encode(batch):
            rows = [row[:max_length] for row in documents(batch["text"])]
            return {"input_ids": rows, "attention_mask": [[1] * len(row) for row in rows]}

        def pack(part):
            stream = [token for row in documents(part["text"]) for token in row]
            blocks = [stream[i : i + max_length] for i in range(0, len(stream) - max_length + 1, max_length)]
            return Dataset.from_dict(
                {"input_ids": blocks, "attention_mask": [[1] * max_length] * len(blocks)}
            )

        splits = {"train": raw.train, "eval": raw.eval}
        if self.packing:
            tokenized = DatasetDict({name: pack(part) for name, part in splits.items()})
            for name, part in tokenized.items():
                if len(part) == 0:
                    raise invalid(
                        "max_length", max_length, f"the {name} split holds fewer tokens than one packed row"
                    )
            return tokenized
        from effitrain.train.data import map_splits

        return map_splits(splits, encode, raw.train.column_names)

    def collator(self, tokenizer):
        return CausalCollator(tokenizer)

    def loss_sum(self, model, batch) -> torch.Tensor:
        """Summed next-token cross-entropy of a micro-batch over its real target tokens; the caller
        divides by the step's real target tokens (:meth:`num_items`, over all micro-batches and
        processes), so micro-batches holding different numbers of tokens weigh as in one big batch.
        With ``loss_chunks`` > 1 the same sum, chunk by chunk, the whole logits never made
        (:mod:`effitrain.config.techniques.chunked_loss`)."""
        if self.loss_chunks > 1:
            from effitrain.config.techniques.chunked_head import chunked_loss_sum

            return chunked_loss_sum(model, model_inputs(batch), batch["labels"], self.loss_chunks)
        logits = model(**model_inputs(batch)).logits
        return shifted_cross_entropy(logits, batch["labels"], reduction="sum")

    def labels_shape(self, rows, length):
        return (rows, length)

    def num_items(self, batch) -> torch.Tensor:
        """Real target tokens: labels other than -100 after the shift (position 0 is never a target)."""
        return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()

    @torch.no_grad()
    def evaluate(self, model, dataloader, accelerator) -> dict:
        """eval/loss, the token mean over the eval split, and eval/perplexity = exp(eval/loss);
        per-row sums are gathered over processes (without the padding rows accelerate adds)."""
        was_training = model.training
        model.eval()
        sums, counts = [], []
        for batch in dataloader:
            labels = batch["labels"]
            row_counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
            gathered = accelerator.gather_for_metrics((self.row_sums(model, batch).double(), row_counts))
            for store, value in zip((sums, counts), gathered):
                store.append(value.cpu())
        model.train(was_training)
        sums, counts = torch.cat(sums), torch.cat(counts)
        total, tokens = sums.sum().item(), int(counts.sum().item())
        loss = total / tokens
        rows = sums[counts > 0] / counts[counts > 0]  # per-row mean losses: the sampling error's spread
        return {
            "eval/loss": loss,
            "eval/perplexity": math.exp(loss),
            "eval/samples": len(counts),
            "eval/tokens": tokens,
            # the eval split's sampling error of eval/loss (over rows): compare's noise with one seed
            "eval/loss_sem": (rows.std() / math.sqrt(len(rows))).item() if len(rows) > 1 else None,
        }

    def row_sums(self, model, batch) -> torch.Tensor:
        """Each row's summed next-token cross-entropy; with ``loss_chunks`` > 1 chunk by chunk, as in
        training: an eval batch (eval_batch_size rows) would otherwise hold its whole logits."""
        labels = batch["labels"]
        if self.loss_chunks > 1:
            from effitrain.config.techniques.chunked_head import chunked_row_sums

            return chunked_row_sums(model, model_inputs(batch), labels, self.loss_chunks)
        logits = model(**model_inputs(batch)).logits
        return shifted_cross_entropy(logits, labels, reduction="none").view(len(labels), -1).sum(dim=1)

    def data_summary(self, raw, tokenized) -> dict:
        """``train/unigram_perplexity``: exp of the entropy of the training split's target tokens,
        what the best model that ignores context scores on that split: the baseline eval/perplexity
        must beat; ``eval/input_blind_loss``, its log, the loss eval/loss must beat."""
        import numpy as np

        targets = np.concatenate(
            [np.asarray(row[1:], dtype=np.int64) for row in tokenized["train"]["input_ids"]]
        )
        counts = np.bincount(targets)
        p = counts[counts > 0] / len(targets)
        entropy = float(-(p * np.log(p)).sum())
        return {
            "train/unigram_perplexity": math.exp(entropy),
            "eval/input_blind_loss": entropy,
            "data/train_rows": len(tokenized["train"]),
            "data/train_target_tokens": int(len(targets)),
        }


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    """Cross-entropy of the prediction at position i against label i + 1, skipping -100 labels."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        labels[:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def end_of_text_id(tokenizer) -> int:
    """The token between documents: the tokenizer's end-of-sequence token, or its separator
    (a WordPiece tokenizer's [SEP]) where it has none."""
    for token_id in (tokenizer.eos_token_id, tokenizer.sep_token_id):
        if token_id is not None:
            return token_id
    raise invalid("model.tokenizer", tokenizer.name_or_path, "it has no end-of-text (eos or sep) token")


class CausalCollator:
    """Pads a list of rows to the longest (right padding) and labels every real token with its id
    and every padding position -100, from the attention mask (so an end-of-text token that doubles
    as the padding token still counts as a target)."""

    def __init__(self, tokenizer):
        from transformers import DataCollatorWithPadding

        if tokenizer.pad_token_id is None:  # decoders often have none; padding is masked anyway
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(end_of_text_id(tokenizer))
        self.pad = DataCollatorWithPadding(tokenizer, return_tensors="pt")

    def __call__(self, rows):
        batch = self.pad([{k: row[k] for k in ("input_ids", "attention_mask")} for row in rows])
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return batch


def macro_f1(predictions: torch.Tensor, labels: torch.Tensor, num_classes: int) -> float:
    """Macro F1 over every class of the head (scikit-learn's ``f1_score`` given all ``num_classes``
    labels): a class that is predicted but absent from the labels counts, with F1 0, and so does a
    class neither predicted nor present (its F1 is undefined; 0, not left out of the mean)."""
    from sklearn.metrics import f1_score

    return float(
        f1_score(
            labels.numpy(),
            predictions.numpy(),
            labels=list(range(num_classes)),
            average="macro",
            zero_division=0,
        )
    )


def build_task(cfg: DictConfig) -> Task:
    """The ``task`` node's class (classification when a config has no task node); a causal LM's
    with the chunks its loss is split into (``loss_chunks``)."""
    from hydra.utils import instantiate

    node = cfg.get("task")
    task = instantiate(node) if node is not None else Classification()
    if isinstance(task, CausalLM):
        from effitrain.config.techniques import LOSS_CHUNKS

        task.loss_chunks = LOSS_CHUNKS.chunks(cfg)
    return task
