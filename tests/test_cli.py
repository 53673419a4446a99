"""``python train.py`` as a user types it: bad input fails fast with one line, and nothing is marked ok."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY, train_py


def _run_dir(tmp_path):
    return f"hydra.run.dir={tmp_path}/run"


def _summaries(tmp_path):
    return [json.loads(p.read_text()) for p in tmp_path.rglob("summary.json")]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optimizer=sgd"], "optimizer='sgd' is not an option: choose one of adafactor, adam8bit, adamw"),
        (["backend=keras"], "backend='keras' is not an option: choose one of accelerator, trainer"),
        (
            ["optimizer.lrr=1e-3"],
            "optimizer.lrr='1e-3' is not a config key: use +optimizer.lrr=... to add one, "
            "or choose one of _partial_, _target_, betas, eps, lr",
        ),
        (
            ["gradient_accumulation_steps=0"],
            "gradient_accumulation_steps=0 is invalid: must be an integer >= 1",
        ),
        (["micro_batch_size=0"], "micro_batch_size=0 is invalid: must be an integer >= 1"),
        (
            [
                "data=hub",
                "data.load_args.path=csv",
                "+data.load_args.data_files={TRAIN}",
                "data.text_column=body",
            ],
            "data.text_column='body' is invalid: no such column: choose one of text, label",
        ),
    ]
    + (
        []
        if torch.cuda.is_available()
        else [(["precision=fp16"], "precision='fp16' is invalid: fp16 needs a CUDA")]
    ),
)
def test_bad_input_is_one_line_nonzero_and_never_ok(tmp_path, overrides, message):
    (tmp_path / "train.csv").write_text("text,label\nhello,0\nworld,1\n")
    overrides = [
        o.replace("{TRAIN}", f"{{train: {tmp_path}/train.csv, test: {tmp_path}/train.csv}}")
        for o in overrides
    ]
    result = train_py(*TINY, *overrides, _run_dir(tmp_path))
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("effitrain: error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in result.stderr
    assert all(summary["status"] != "ok" for summary in _summaries(tmp_path))
