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


class _Clock:
    """A clock the test moves by hand: the meter's arithmetic, not the machine's load, is under test."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_meter_throughput_is_work_over_time_with_an_injected_clock():
    clock = _Clock()
    meter = StepMeter(num_steps=8, loggers=[], device="cpu", progress_bar=False, is_main=True,
                      task=Classification(), clock=clock)  # fmt: skip
    meter.start()
    # 8 steps of 0.05 s, the first "compiles" (+0.3 s), the third is tracked for memory (+0.2 s)
    durations = [SLEEP_S + {1: 0.3, 3: 0.2}.get(step, 0.0) for step in range(1, 9)]
    for step, seconds in enumerate(durations, start=1):
        # 3 micro-batches of 4 samples x 10 real tokens (+5 padding)
        for _ in range(3):
            meter.add(torch.tensor(1.0), _batch(4, 10, 5))
        if step == 3:
            meter.leave_untimed()
        clock.now += seconds
        meter.end_step(step, lr=1e-3, grad_norm=1.0)
    clock.now += 5.0  # after the last step: not training time
    summary = meter.summary()
    assert (summary["train/samples"], summary["train/tokens"]) == (8 * 12, 8 * 120)  # padding not counted
    train_s = 8 * SLEEP_S + 0.5
    assert summary["speed/train_s"] == pytest.approx(train_s, rel=1e-12)
    assert summary["speed/samples_per_s"] == pytest.approx(96 / train_s, rel=1e-12)
    assert summary["speed/tokens_per_s"] == pytest.approx(960 / train_s, rel=1e-12)
    assert meter.step_times == pytest.approx(durations, rel=1e-12)
    # the steady steps: the tracked third left out, then the first WARMUP_STEPS of the rest
    assert WARMUP_STEPS == 2 and summary["speed/step_s_median"] == pytest.approx(SLEEP_S, rel=1e-12)
    assert summary["speed/tracked_step_s"] == pytest.approx(SLEEP_S + 0.2, rel=1e-12)
    assert summary["speed/first_step_overhead_s"] == pytest.approx(0.3, rel=1e-9)


def test_an_evaluation_between_steps_is_left_out_of_the_next_step_s_time():
    clock = _Clock()
    meter = StepMeter(num_steps=2, loggers=[], device="cpu", progress_bar=False, is_main=True,
                      task=Classification(), clock=clock)  # fmt: skip
    meter.start()
    meter.add(torch.tensor(1.0), _batch(4, 10, 0))
    clock.now += 1.0
    meter.end_step(1, lr=1e-3, grad_norm=None)
    clock.now += 7.0  # an evaluation
    meter.exclude(7.0)
    meter.add(torch.tensor(1.0), _batch(4, 10, 0))
    clock.now += 2.0
    meter.end_step(2, lr=1e-3, grad_norm=None)
    assert meter.step_times == [1.0, 2.0] and meter.summary()["speed/train_s"] == 3.0


def test_starting_the_meter_reads_the_process_start_before_its_clock(monkeypatch):
    """What start() does after reading its clock is the first step's time: importing psutil (tens
    of ms on a loaded machine) must come before."""
    import effitrain.train.step as step_module

    clock, seen = _Clock(), []
    monkeypatch.setattr(step_module, "process_started", lambda: seen.append(clock.now) or 0.0)
    meter = StepMeter(num_steps=1, loggers=[], device="cpu", progress_bar=False, is_main=True,
                      task=Classification(), clock=lambda: seen.append("clock") or clock.now)  # fmt: skip
    meter.start()
    assert seen == [100.0, "clock"]


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
