"""The tasks' hooks (effitrain.train.tasks) on hand-made logits, labels and rows, each figure computed here
with ``math`` (no torch loss): the summed losses, the items that normalize them, the evaluation
metrics of both tasks, the causal collator's labels, tokenizing and packing, the unigram baseline.
No model is trained: these run in milliseconds, so the mutation run (docs/testing.md, "Mutation testing")
can afford them per mutant."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from effitrain.config.errors import ConfigError
from effitrain.train.tasks import (
    IGNORE_INDEX,
    CausalCollator,
    CausalLM,
    Classification,
    build_task,
    data_node,
    end_of_text_id,
    model_inputs,
    shifted_cross_entropy,
)


class _FixedLogits(torch.nn.Module):
    """A model answering the given logits for the rows a batch names (``row``), recording its calls."""

    def __init__(self, logits):
        super().__init__()
        self.logits, self.calls = logits, []

    def forward(self, row, **inputs):
        self.calls.append(sorted(inputs))
        return SimpleNamespace(logits=self.logits[row])


class _OneProcess:
    def gather_for_metrics(self, values):
        return values


def _nll(row_logits, target):
    """-log softmax(row_logits)[target], by hand."""
    return -(row_logits[target] - math.log(sum(math.exp(v) for v in row_logits)))


def test_model_inputs_drop_only_the_labels_and_data_node_drops_packing():
    batch = {"input_ids": 1, "attention_mask": 2, "labels": 3, "token_type_ids": 4}
    assert model_inputs(batch) == {"input_ids": 1, "attention_mask": 2, "token_type_ids": 4}
    node = data_node(
        OmegaConf.create({"a": 1, "packing": True, "label_column": "y", "c": "${a}"}), label_column=None, b=2
    )
    assert OmegaConf.to_container(node) == {"a": 1, "label_column": None, "c": 1}  # b: no such parameter


def test_classification_loss_sum_items_and_tokens():
    values = [[2.0, -1.0, 0.5], [0.0, 1.0, 3.0]]
    model = _FixedLogits(torch.tensor(values))
    batch = {
        "row": torch.tensor([0, 1]),
        "labels": torch.tensor([0, 1]),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
    }
    task = Classification()
    loss = task.loss_sum(model, batch)
    assert loss.item() == pytest.approx(_nll(values[0], 0) + _nll(values[1], 1), rel=1e-6)
    assert model.calls == [["attention_mask"]]  # the labels never reach the model
    assert task.num_items(batch) == 2
    assert int(task.num_tokens(batch)) == 5  # real tokens, not padding
    assert task.num_tokens({"input_ids": torch.zeros(3, 4)}) == 12  # no mask: every position
    assert task.labels_shape(5, 7) == (5,)
    assert task.cache_key() == {"task": "classification"}


def test_classification_evaluate_restores_the_mode_and_gives_the_loss_s_sampling_error():
    values = [[1.0, 0.0], [0.0, 2.0], [0.5, 0.0]]
    model = _FixedLogits(torch.tensor(values))
    model.train()
    batches = [
        {"row": torch.tensor([0, 1]), "labels": torch.tensor([0, 0])},
        {"row": torch.tensor([2]), "labels": torch.tensor([1])},
    ]
    metrics = Classification().evaluate(model, batches, _OneProcess())
    assert model.training  # back in training mode
    losses = [_nll(values[0], 0), _nll(values[1], 0), _nll(values[2], 1)]
    mean = sum(losses) / 3
    sem = math.sqrt(sum((x - mean) ** 2 for x in losses) / 2) / math.sqrt(3)
    assert metrics["eval/loss"] == pytest.approx(mean, rel=1e-6)
    assert metrics["eval/loss_sem"] == pytest.approx(sem, rel=1e-5)
    assert metrics["eval/accuracy"] == pytest.approx(1 / 3, rel=1e-6)
    assert metrics["eval/samples"] == 3
    model.eval()
    single = Classification().evaluate(model, batches[1:], _OneProcess())
    assert not model.training and single["eval/loss_sem"] is None  # one sample: no spread


def test_shifted_cross_entropy_scores_position_i_against_label_i_plus_1():
    values = [[[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [3.0, 0.0, 1.0]]]
    logits = torch.tensor(values)
    labels = torch.tensor([[2, 1, IGNORE_INDEX]])
    total = shifted_cross_entropy(logits, labels, reduction="sum").item()
    assert total == pytest.approx(_nll(values[0][0], 1), rel=1e-6)  # the -100 target is skipped
    per = shifted_cross_entropy(logits, labels, reduction="none")
    assert per.shape == (2,) and per[1].item() == 0.0


def test_causal_loss_sum_items_and_evaluate_over_real_target_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 5)
    labels = torch.tensor(
        [[1, 2, 3, 4], [0, 4, IGNORE_INDEX, IGNORE_INDEX], [2, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    )
    model = _FixedLogits(logits)
    task = CausalLM()
    batch = {"row": torch.arange(3), "labels": labels}
    per_row = []
    for r in range(3):
        nll = [
            _nll(logits[r, i].tolist(), int(labels[r, i + 1]))
            for i in range(3)
            if labels[r, i + 1] != IGNORE_INDEX
        ]
        per_row.append(nll)
    assert task.loss_sum(model, batch).item() == pytest.approx(sum(map(sum, per_row)), rel=1e-5)
    assert int(task.num_items(batch)) == 4 and int(task.num_tokens(batch)) == 4
    assert task.labels_shape(5, 7) == (5, 7)
    assert task.cache_key() == {"task": "causal_lm", "packing": False}
    assert CausalLM(packing=True).cache_key() == {"task": "causal_lm", "packing": True}

    model.train()
    batches = [
        {"row": torch.tensor([0, 1]), "labels": labels[:2]},
        {"row": torch.tensor([2]), "labels": labels[2:]},
    ]
    metrics = task.evaluate(model, batches, _OneProcess())
    assert model.training
    loss = sum(map(sum, per_row)) / 4
    assert metrics["eval/loss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["eval/perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert (metrics["eval/samples"], metrics["eval/tokens"]) == (3, 4)
    rows = [sum(nll) / len(nll) for nll in per_row if nll]  # the row without a target is left out
    mean = sum(rows) / 2
    sem = math.sqrt(sum((x - mean) ** 2 for x in rows)) / math.sqrt(2)
    assert metrics["eval/loss_sem"] == pytest.approx(sem, rel=1e-5)
    first_two = task.evaluate(model, batches[:1], _OneProcess())
    two = rows[:2]
    assert first_two["eval/loss_sem"] == pytest.approx(abs(two[0] - two[1]) / 2, rel=1e-5)
    one_row = task.evaluate(model, [{"row": torch.tensor([1]), "labels": labels[1:2]}], _OneProcess())
    assert one_row["eval/loss_sem"] is None


def test_packing_must_be_a_boolean():
    with pytest.raises(ConfigError, match=r"^data\.packing='yes' is invalid: must be true or false$"):
        CausalLM(packing="yes")


def _raw(train: int, eval: int, label_column="label"):
    """A data loader's result (``load`` instantiates this): ``train`` and ``eval`` texts."""
    return SimpleNamespace(train=["t"] * train, eval=["e"] * eval, label_column=label_column)


def test_causal_load_reads_texts_only_and_refuses_an_empty_split():
    node = {"_target_": f"{__name__}._raw", "label_column": "label", "packing": True}
    raw = CausalLM().load(OmegaConf.create({**node, "train": 2, "eval": 1}))
    assert (len(raw.train), len(raw.eval), raw.label_column) == (2, 1, None)  # labels unread
    for train, eval, split in ((0, 1, "train"), (1, 0, "eval")):
        with pytest.raises(
            ConfigError,
            match=rf"^data \({split} split\)=0 is invalid: the split is empty: it needs at least one sample$",
        ):
            CausalLM().load(OmegaConf.create({**node, "train": train, "eval": eval}))


def test_end_of_text_is_eos_else_sep_else_refused():
    assert end_of_text_id(SimpleNamespace(eos_token_id=7, sep_token_id=3)) == 7
    assert end_of_text_id(SimpleNamespace(eos_token_id=0, sep_token_id=3)) == 0  # id 0 is a token
    assert end_of_text_id(SimpleNamespace(eos_token_id=None, sep_token_id=3)) == 3
    with pytest.raises(ConfigError, match=r"^model\.tokenizer='tok' is invalid: it has no end-of-text"):
        end_of_text_id(SimpleNamespace(eos_token_id=None, sep_token_id=None, name_or_path="tok"))


def test_build_task_defaults_to_classification():
    assert type(build_task(OmegaConf.create({}))) is Classification
    task = build_task(
        OmegaConf.create({"task": {"_target_": "effitrain.train.tasks.CausalLM", "packing": True}})
    )
    assert type(task) is CausalLM and task.packing is True


def test_the_unigram_baseline_is_exp_of_the_target_tokens_entropy():
    from datasets import Dataset

    tokenized = {"train": Dataset.from_dict({"input_ids": [[9, 1, 1, 2], [9, 2], [9], [9, 1, 3]]})}
    summary = CausalLM().data_summary(None, tokenized)
    # targets (position 0 is none; a one-token row has none): 1, 1, 2, 2, 1, 3 -> p = 1/2, 1/3, 1/6
    entropy = -sum(p * math.log(p) for p in (1 / 2, 1 / 3, 1 / 6))
    assert summary["train/unigram_perplexity"] == pytest.approx(math.exp(entropy), rel=1e-12)
    assert (summary["data/train_rows"], summary["data/train_target_tokens"]) == (4, 6)
    assert summary["eval/input_blind_loss"] == pytest.approx(entropy, rel=1e-12)


def test_a_classifier_s_input_blind_loss_is_the_prior_s_or_the_uniform_s_whichever_is_lower():
    from types import SimpleNamespace

    raw = SimpleNamespace(train={"label": [0, 0, 0, 1]}, eval={"label": [0, 1]}, label_names=["a", "b", "c"])
    prior = -(0.5 * math.log(3 / 4) + 0.5 * math.log(1 / 4))  # 0.837, below ln 3 = 1.099
    assert Classification().data_summary(raw, None) == {
        "eval/input_blind_loss": pytest.approx(prior, rel=1e-12)
    }
    raw.eval = {"label": [2, 1]}  # a class the prior gives no mass: its loss is infinite, uniform's is ln 3
    assert Classification().data_summary(raw, None) == {"eval/input_blind_loss": pytest.approx(math.log(3))}
    raw.train, raw.eval = {"label": [0, 1]}, {"label": [0, 0, 0, 1]}  # uniform (ln 2 < ln 3) wins on 2 names
    raw.label_names = ["a", "b"]
    assert Classification().data_summary(raw, None) == {"eval/input_blind_loss": pytest.approx(math.log(2))}


@pytest.fixture(scope="module")
def tokenizer():
    from effitrain.train.modeling import build_tokenizer
    from tests.helpers.run import compose

    return build_tokenizer(compose("task=causal_lm", "model=llama_tiny").model)


def test_a_tokenizer_without_padding_pads_with_its_end_of_text_and_one_with_keeps_its_own(tokenizer):
    import copy

    own = tokenizer.pad_token_id
    CausalCollator(tokenizer)
    assert tokenizer.pad_token_id == own == 0  # MiniLM's [PAD] kept
    bare = copy.deepcopy(tokenizer)
    bare.pad_token = None
    CausalCollator(bare)
    assert bare.pad_token_id == end_of_text_id(bare) == bare.sep_token_id


def test_causal_build_model_on_meta_allocates_nothing(tokenizer):
    from tests.helpers.run import compose

    cfg = compose("task=causal_lm", "model=llama_tiny").model
    model = CausalLM().build_model(cfg, None, tokenizer, "meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)


def test_the_causal_collator_labels_real_tokens_even_when_padding_shares_their_id(tokenizer):
    collate = CausalCollator(tokenizer)
    pad = tokenizer.pad_token_id
    rows = [
        {"input_ids": [5, 6, pad], "attention_mask": [1, 1, 1]},
        {"input_ids": [7], "attention_mask": [1]},
    ]
    batch = collate(rows)
    assert batch["input_ids"].tolist() == [[5, 6, pad], [7, pad, pad]]
    assert batch["labels"].tolist() == [[5, 6, pad], [7, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


class _WordTokenizer:
    """One id per word (its length + 10; "|" is the end-of-text id 2), no end-of-text of its own."""

    eos_token_id, sep_token_id = 2, None

    def __call__(self, texts):
        return {"input_ids": [[2 if w == "|" else len(w) + 10 for w in text.split()] for text in texts]}


def test_tokenize_ends_each_document_once_and_packs_rows_of_max_length():
    from datasets import Dataset

    texts = ["aa bbb", "", "c dddd eeeee", "ff |"]
    raw = SimpleNamespace(
        train=Dataset.from_dict({"text": texts, "label": [0, 1, 0, 1]}),
        eval=Dataset.from_dict({"text": texts[2:], "label": [0, 1]}),
    )
    # eos appended where a document does not end with it; an empty one is the eos alone
    docs = [[12, 13, 2], [2], [11, 14, 15, 2], [12, 2]]
    rows = CausalLM().tokenize(raw, _WordTokenizer(), max_length=3)
    assert rows["train"].column_names == ["input_ids", "attention_mask"]  # text and labels dropped
    assert rows["train"]["input_ids"] == [[12, 13, 2], [2], [11, 14, 15], [12, 2]]
    assert rows["train"]["attention_mask"] == [[1, 1, 1], [1], [1, 1, 1], [1, 1]]
    assert rows["eval"]["input_ids"] == [[11, 14, 15], [12, 2]]
    # packed: the 10-token stream in rows of 5 (two, nothing left), of 3 (three, one token dropped)
    stream = [t for d in docs for t in d]
    packed = CausalLM(packing=True).tokenize(raw, _WordTokenizer(), max_length=5)
    assert packed["train"]["input_ids"] == [stream[:5], stream[5:]]
    assert packed["train"]["attention_mask"] == [[1] * 5] * 2
    assert packed["eval"]["input_ids"] == [[11, 14, 15, 2, 12]]  # 6 tokens: one row of 5
    packed = CausalLM(packing=True).tokenize(raw, _WordTokenizer(), max_length=3)
    assert packed["train"]["input_ids"] == [stream[0:3], stream[3:6], stream[6:9]]
    assert packed["eval"]["input_ids"] == [[11, 14, 15], [2, 12, 2]]
    with pytest.raises(ConfigError, match=r"^max_length=11 is invalid: the train split holds fewer tokens"):
        CausalLM(packing=True).tokenize(raw, _WordTokenizer(), max_length=11)


class _RecordingTokenizer:
    """Each word one id (its length), truncated only when asked; records how it was called."""

    def __init__(self):
        self.calls = []

    def __call__(self, texts, truncation=False, max_length=None):
        self.calls.append((type(texts), truncation, max_length))
        ids = [[len(w) for w in text.split()] for text in texts]
        ids = [row[:max_length] for row in ids] if truncation else ids
        return {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]}


def test_classification_tokenize_truncates_in_batches_and_keeps_the_labels():
    from datasets import Dataset

    raw = SimpleNamespace(
        train=Dataset.from_dict({"text": ["a bb ccc dddd", "ee"], "label": [1, 0]}),
        eval=Dataset.from_dict({"text": ["fff g"], "label": [1]}),
    )
    tokenizer = _RecordingTokenizer()
    rows = Classification().tokenize(raw, tokenizer, max_length=3)
    assert rows["train"]["input_ids"] == [[1, 2, 3], [2]] and rows["eval"]["input_ids"] == [[3, 1]]
    assert rows["train"]["labels"] == [1, 0] and rows["train"].column_names == [
        "labels",
        "input_ids",
        "attention_mask",
    ]
    assert {call for call in tokenizer.calls} == {(list, True, 3)}  # batches of texts


def test_classification_collator_pads_to_tensors_and_the_head_names_the_labels(tokenizer):
    from tests.helpers.run import compose

    batch = Classification().collator(tokenizer)(
        [{"input_ids": [5, 6, 7], "labels": 1}, {"input_ids": [8], "labels": 0}]
    )
    assert isinstance(batch["input_ids"], torch.Tensor)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]] and batch["labels"].tolist() == [1, 0]
    raw = SimpleNamespace(label_names=["neg", "pos", "mixed"])
    model = Classification().build_model(compose("model=tiny").model, raw, tokenizer, "meta")
    assert model.config.id2label == {0: "neg", 1: "pos", 2: "mixed"}
    assert model.config.label2id == {"neg": 0, "pos": 1, "mixed": 2}
    assert model.num_labels == 3 and {p.device.type for p in model.parameters()} == {"meta"}


def test_macro_f1_counts_a_class_neither_predicted_nor_present_as_0_without_a_warning():
    import warnings

    from effitrain.train.tasks import macro_f1

    labels, predictions = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 1, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zero_division given: scikit-learn does not warn
        f1 = macro_f1(predictions, labels, 4)
    # class 0: precision 1, recall 1/2 -> 2/3; class 1: 2/3 and 1 -> 4/5; classes 2 and 3: 0
    assert f1 == pytest.approx((2 / 3 + 4 / 5 + 0 + 0) / 4, abs=1e-12)
