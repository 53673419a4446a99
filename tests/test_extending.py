"""What docs/extending.md promises: an optimizer or a model is one YAML file in
conf/, a task is two files (its YAML and its class). Each is added to a copy of the package, and
``effitrain check`` and a run use it from there, with no other file changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.run import REPO

pytestmark = pytest.mark.slow  # a copy of the package and three runs, each in its own process

SGD = """\
# SGD with momentum: one fp32 buffer per parameter.
_target_: torch.optim.SGD
_partial_: true
lr: 1.0e-2
momentum: 0.9
"""

TINY_DEEP = (
    (REPO / "conf" / "model" / "tiny.yaml")
    .read_text()
    .replace("num_hidden_layers: 2", "num_hidden_layers: 3")
)

SMOOTHED_YAML = """\
# @package _global_
task:
  _target_: my_tasks.SmoothedClassification
  smoothing: 0.1
"""

SMOOTHED_CLASS = '''\
import torch.nn.functional as F

from effitrain.train.tasks import Classification, Metric, model_inputs


class SmoothedClassification(Classification):
    """Classification trained on label-smoothed cross-entropy; reports its error rate too."""

    name = "smoothed"
    metrics = (*Classification.metrics, Metric("eval/error_rate", "error", higher_is_better=False))

    def __init__(self, smoothing: float = 0.1):
        self.smoothing = smoothing

    def loss_sum(self, model, batch):
        logits = model(**model_inputs(batch)).logits
        return F.cross_entropy(logits.float(), batch["labels"], reduction="sum", label_smoothing=self.smoothing)

    def evaluate(self, model, dataloader, accelerator):
        metrics = super().evaluate(model, dataloader, accelerator)
        return {**metrics, "eval/error_rate": 1 - metrics["eval/accuracy"]}
'''

RUN = ["model=tiny", "data=synthetic", "max_steps=2", "progress_bar=false", "logger=none"]


@pytest.fixture(scope="module")
def extended(tmp_path_factory) -> Path:
    """A copy of the package with its configs inside (as the wheel holds them), plus the new files:
    conf/optimizer/sgd_momentum.yaml, conf/model/tiny_deep.yaml, conf/task/smoothed.yaml and the
    task's class in my_tasks.py beside it."""
    root = tmp_path_factory.mktemp("extended")
    shutil.copytree(REPO / "effitrain", root / "effitrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "conf", root / "effitrain" / "conf", symlinks=False)
    conf = root / "effitrain" / "conf"
    (conf / "optimizer" / "sgd_momentum.yaml").write_text(SGD)
    (conf / "model" / "tiny_deep.yaml").write_text(TINY_DEEP)
    (conf / "task" / "smoothed.yaml").write_text(SMOOTHED_YAML)
    (root / "my_tasks.py").write_text(SMOOTHED_CLASS)
    return root


def effitrain(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "effitrain.cli", *args], cwd=root, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def run(root: Path, name: str, *overrides: str) -> tuple[dict, str]:
    done = effitrain(root, "train", *RUN, *overrides, f"hydra.run.dir={root / 'runs' / name}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((root / "runs" / name / "summary.json").read_text()), done.stdout


@pytest.fixture(scope="module")
def plain(extended) -> dict:
    """The copy's run of the tiny classifier with the defaults: what each addition is compared with."""
    return run(extended, "plain")[0]


def test_the_copy_is_what_runs(extended):
    done = subprocess.run(
        [sys.executable, "-c", "import effitrain.config.registry as r; print(r.CONF_DIR)"],
        cwd=extended, env=dict(os.environ, PYTHONPATH=str(extended)), capture_output=True, text=True,
    )  # fmt: skip
    assert done.stdout.strip() == str(extended / "effitrain" / "conf")
    listed = effitrain(extended, "check", "optimizer=nope")
    assert listed.returncode == 2 and "sgd_momentum" in listed.stderr  # an option of the group now


def test_an_optimizer_is_one_yaml_file_and_its_state_is_measured_and_predicted(extended):
    assert effitrain(extended, "check", "optimizer=sgd_momentum").returncode == 0
    summary, _ = run(extended, "sgd", "optimizer=sgd_momentum")
    assert summary["cfg/optimizer"] == "sgd_momentum" and summary["status"] == "ok"
    # SGD's momentum: one fp32 buffer per trainable parameter, no more
    assert summary["mem/optimizer_state_bytes"] == 4 * summary["params/trainable"]
    assert summary["mem/step_peak_bytes_predicted"] == summary["mem/step_peak_bytes"]


def test_a_model_is_one_yaml_file(extended, plain):
    deep, _ = run(extended, "deep", "model=tiny_deep")
    # one more BERT layer of 32 hidden units and 64 intermediate: q, k, v and the attention output
    # (4 x (32 x 32 + 32)), two layer norms (2 x 64), the feed-forward (32 x 64 + 64 + 64 x 32 + 32)
    assert deep["params/total"] - plain["params/total"] == 4 * (32 * 32 + 32) + 2 * 64 + (
        32 * 64 + 64 + 64 * 32 + 32
    )


def test_a_task_is_two_files_its_yaml_and_its_class(extended, plain):
    assert effitrain(extended, "check", "task=smoothed").returncode == 0
    smoothed, printed = run(extended, "smoothed", "task=smoothed")
    assert smoothed["eval/error_rate"] == pytest.approx(1 - smoothed["eval/accuracy"])
    assert f"eval/error_rate {smoothed['eval/error_rate']:.4f}" in printed  # the run's closing line
    first = [json.loads(line) for line in (extended / "runs" / "smoothed" / "metrics.jsonl").open()][0]
    plain_first = [json.loads(line) for line in (extended / "runs" / "plain" / "metrics.jsonl").open()][0]
    # the same weights and batch at step 1: the task's loss is what differs
    assert first["step"] == plain_first["step"] == 1 and first["train/loss"] != plain_first["train/loss"]
    assert plain["eval/samples"] == smoothed["eval/samples"]
