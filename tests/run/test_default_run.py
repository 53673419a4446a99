"""The real default configuration (MiniLM on drug reviews), a few steps, as a user starts it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.run import read_metrics, train_py


@pytest.mark.slow
def test_default_configuration_runs_a_few_steps(tmp_path):
    result = train_py("max_steps=3", "progress_bar=false", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["cfg/model"] == "minilm" and summary["cfg/data"] == "drug_reviews"
    assert summary["cfg/optimizer"] == "adamw" and summary["cfg/backend"] == "accelerator"
    assert summary["params/total"] == 22_713_216 + 384 * 3 + 3  # MiniLM + a 3-class head
    assert summary["eval/samples"] == 379
    assert summary["train/samples"] == 3 * 16 and summary["train/steps"] == 3
    assert [line["step"] for line in read_metrics(tmp_path)] == [1, 2, 3]
    assert "effitrain: ok:" in result.stdout
