"""A task declares the metrics it writes once (effitrain/train/tasks.py ``Task.metrics``); compare's tables,
its verdict and a run's closing line read them from there."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from effitrain.config.summary_schema import reported_metrics
from effitrain.train.tasks import CausalLM, Classification


class _Logits(torch.nn.Module):
    """A model whose logits are given, whatever the batch holds."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, **_):
        return SimpleNamespace(logits=self.logits)


class _OneProcess:
    def gather_for_metrics(self, values):
        return values


def test_each_task_writes_the_metrics_it_declares():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    batch = {"input_ids": torch.zeros(3, 2, dtype=torch.long), "labels": torch.tensor([0, 1, 1])}
    written = Classification().evaluate(_Logits(logits), [batch], _OneProcess())
    assert [m.key for m in Classification.metrics] == ["eval/accuracy", "eval/f1"]
    assert written["eval/accuracy"] == pytest.approx(2 / 3)
    assert written["eval/f1"] == pytest.approx((2 / 3 + 2 / 3) / 2)

    # a decoder over 2 tokens that always predicts token 0 with probability 1/2 (uniform logits)
    rows = {"input_ids": torch.tensor([[0, 1, 0]]), "labels": torch.tensor([[0, 1, 0]])}
    causal = CausalLM()
    written = causal.evaluate(_Logits(torch.zeros(1, 3, 2)), [rows], _OneProcess())
    written |= causal.data_summary(None, {"train": {"input_ids": [[5, 0, 1, 1, 1]]}})  # targets 0, 1, 1, 1
    assert [m.key for m in CausalLM.metrics] == ["eval/perplexity", "train/unigram_perplexity"]
    assert written["eval/perplexity"] == pytest.approx(2.0)
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert written["train/unigram_perplexity"] == pytest.approx(math.exp(entropy))


def test_compare_shows_the_declared_metrics_in_the_order_of_the_task_classes():
    from effitrain.compare.learning import QUALITY_KEYS
    from effitrain.compare.load import SEED_KEYS
    from effitrain.compare.table import COLUMNS, HIGHER_IS_BETTER, LOWER_IS_BETTER, SEED_COLUMNS

    shown = [("eval/accuracy", "accuracy", 4), ("eval/f1", "F1", 4), ("eval/perplexity", "perplexity", 2)]
    assert [(m.key, m.label, m.digits) for m in reported_metrics()] == shown  # unigram: printed only
    assert [(c.key, c.header, c.digits) for c in COLUMNS[8:11]] == shown
    assert [c.header for c in COLUMNS[7:12]] == ["eval loss", "accuracy", "F1", "perplexity", "samples/s"]
    assert SEED_KEYS[1:4] == [key for key, _, _ in shown] == list(QUALITY_KEYS)
    assert [c.header for c in SEED_COLUMNS][:5] == [
        "eval loss",
        "accuracy",
        "F1",
        "perplexity",
        "train loss (mean)",
    ]
    assert {"accuracy", "F1"} <= HIGHER_IS_BETTER and "perplexity" in LOWER_IS_BETTER


def test_data_made_in_code_gets_the_label_checks_too(tmp_path):
    """One training sample holds one class, the eval split three: refused in one line, as data=hub's
    label column would be, not a run that scores a class it never trained on."""
    from tests.helpers.run import run_job

    summary = run_job(tmp_path, "data.num_train=1", "max_steps=1")
    assert (summary["status"], summary["error_type"]) == ("failed", "config")
    assert summary["error"].startswith("data.num_train=1 is invalid: the train split holds a single class (")
    assert summary["error"].endswith("): classification needs at least 2")
