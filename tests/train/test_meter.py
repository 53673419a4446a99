"""Throughput is total work over total time: a known sleep per step bounds it exactly."""

from __future__ import annotations

import time

import pytest
import torch

from effitrain.train.step import WARMUP_STEPS, StepMeter
from effitrain.train.tasks import Classification
from tests.helpers.run import run_job

SLEEP_S = 0.05


def _batch(samples: int, tokens_per_sample: int, padding: int):
    mask = torch.ones(samples, tokens_per_sample + padding, dtype=torch.long)
    mask[:, tokens_per_sample:] = 0
    return {"labels": torch.zeros(samples, dtype=torch.long), "attention_mask": mask}


def test_meter_throughput_is_work_over_time_with_a_known_sleep():
    meter = StepMeter(
        num_steps=8, loggers=[], device="cpu", progress_bar=False, is_main=True, task=Classification()
    )
    meter.start()
    started = time.perf_counter()
    for step in range(1, 9):
        # 3 micro-batches of 4 samples x 10 real tokens (+5 padding); the first step "compiles"
        for _ in range(3):
            meter.add(torch.tensor(1.0), _batch(4, 10, 5))
        if step == 3:  # tracked for memory: slower, and out of the median
            meter.leave_untimed()
        time.sleep(SLEEP_S + {1: 0.3, 3: 0.2}.get(step, 0.0))
        meter.end_step(step, lr=1e-3, grad_norm=1.0)
    elapsed = time.perf_counter() - started
    summary = meter.summary()
    assert (summary["train/samples"], summary["train/tokens"]) == (8 * 12, 8 * 120)  # padding not counted
    assert summary["speed/train_s"] == pytest.approx(elapsed, abs=0.01)
    assert summary["speed/samples_per_s"] == summary["train/samples"] / summary["speed/train_s"]
    assert summary["speed/tokens_per_s"] == summary["train/tokens"] / summary["speed/train_s"]
    # never above work / slept time: sleeping is a lower bound on the time spent
    assert summary["speed/samples_per_s"] <= 96 / (8 * SLEEP_S + 0.5)
    assert summary["speed/samples_per_s"] >= 0.5 * 96 / (8 * SLEEP_S + 0.5)
    steady = [t for i, t in enumerate(meter.step_times) if i != 2][WARMUP_STEPS:]
    assert len(steady) == 5 and SLEEP_S <= summary["speed/step_s_median"] < 2 * SLEEP_S
    assert summary["speed/tracked_step_s"] == meter.step_times[2] >= SLEEP_S + 0.2
    assert summary["speed/first_step_overhead_s"] == pytest.approx(0.3, abs=0.1)


@pytest.mark.slow
def test_run_throughput_with_a_sleep_per_micro_batch(tmp_path, monkeypatch):
    from effitrain.train.tasks import Classification

    real_loss_sum = Classification.loss_sum

    def slow_loss_sum(self, model, batch):
        time.sleep(SLEEP_S)
        return real_loss_sum(self, model, batch)

    monkeypatch.setattr(Classification, "loss_sum", slow_loss_sum)
    summary = run_job(tmp_path, "max_steps=4", "gradient_accumulation_steps=2")
    assert summary["status"] == "ok", summary["error"]
    assert summary["train/samples"] == 4 * 2 * 8
    assert summary["speed/train_s"] >= 8 * SLEEP_S
    assert summary["speed/samples_per_s"] == summary["train/samples"] / summary["speed/train_s"]
    assert summary["speed/samples_per_s"] <= 64 / (8 * SLEEP_S)


@pytest.mark.slow
@pytest.mark.parametrize("compile_", ["off", "on"])
def test_compile_time_is_dynamo_s_own_and_null_without_compile(tmp_path, compile_):
    summary = run_job(tmp_path, f"compile={compile_}", "compile.backend=aot_eager", "max_steps=3")
    assert summary["status"] == "ok", summary["error"]
    if compile_ == "off":
        assert summary["speed/compile_s"] is None
    else:
        assert 0 < summary["speed/compile_s"] < summary["speed/train_s"]
