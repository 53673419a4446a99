"""The shared step's pieces (effitrain.train.step) on hand-made inputs, each figure computed here:
the loss normalization, accumulation windows, the resumed epoch's iterator, the step meter's lines
and summary (train/loss_mean across a resume included). No model is trained: these run in
milliseconds, so the mutation run (docs/testing.md, "Mutation testing") can afford them per mutant."""

from __future__ import annotations

import contextlib
import math
import time

import psutil
import pytest
import torch

from effitrain.train.step import (
    StepMeter,
    StepOps,
    TrainingDiverged,
    accumulation_windows,
    epoch_batches,
    process_started,
    step_items,
    step_loss,
    window_step,
)
from effitrain.train.tasks import CausalLM, Classification


class _Logger:
    def __init__(self):
        self.lines = []

    def log_dict(self, payload, step):
        self.lines.append((step, dict(payload)))


def _meter(task=None, **kwargs):
    args = dict(num_steps=4, loggers=[], device="cpu", progress_bar=False, is_main=True)
    args.update(kwargs)
    return StepMeter(task=task or Classification(), **args)


def _classification_batch(rows: int, real: int, padding: int = 0):
    mask = torch.ones(rows, real + padding, dtype=torch.long)
    mask[:, real:] = 0
    return {"labels": torch.zeros(rows, dtype=torch.long), "attention_mask": mask}


def test_step_loss_is_the_sum_over_the_step_s_items_times_the_processes():
    assert step_loss(torch.tensor(6.0), 4, 1).item() == 1.5
    assert step_loss(torch.tensor(6.0), 4, 2).item() == 3.0
    assert step_loss(torch.tensor(6.0), 3, 3).item() == 6.0


def test_accumulation_windows_cut_the_batches_in_order_the_last_shorter():
    assert list(accumulation_windows(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(accumulation_windows(range(4), 2)) == [[0, 1], [2, 3]]
    assert list(accumulation_windows(range(2), 1)) == [[0], [1]]
    assert list(accumulation_windows([], 2)) == []


def test_step_items_sum_the_task_s_items_of_the_window():
    window = [_classification_batch(3, 5), _classification_batch(2, 5)]
    assert step_items(Classification(), window, "cpu") == 5
    causal = {"labels": torch.tensor([[1, 2, 3, -100], [4, 5, -100, -100]])}
    # position 0 is never a target: 2 + 1 real target tokens
    assert step_items(CausalLM(), [causal, causal], "cpu") == 6


class _Loader:
    def __init__(self, items):
        self.items, self.epochs = items, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(self.items)


def test_epoch_batches_set_the_epoch_skip_the_consumed_and_restore_the_generators():
    from effitrain.train.rng import rng_state

    loader = _Loader(["a", "b", "c", "d"])
    assert list(epoch_batches(loader, 3)) == ["a", "b", "c", "d"] and loader.epochs == [3]
    assert list(epoch_batches(loader, 5, skip=1)) == ["b", "c", "d"] and loader.epochs == [3, 5]
    torch.manual_seed(7)
    saved = rng_state()
    expected = torch.rand(3)
    rest = epoch_batches(loader, 0, skip=2, rng_state=saved)
    assert torch.equal(torch.rand(3), expected)  # the generators are the checkpoint's again
    assert list(rest) == ["c", "d"]


class _SquaredSum:
    def loss_sum(self, model, batch):
        return (model(batch["x"]) ** 2).sum()


class _Recorder:
    def __init__(self):
        self.added = []

    def add(self, loss, batch):
        self.added.append((loss.item(), batch))


def test_window_step_calls_before_forward_per_batch_and_leaves_no_gradient():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    window = [{"x": torch.tensor([[1.0, 2.0]])}, {"x": torch.tensor([[0.5, -1.0], [2.0, 0.0]])}]
    seen = []
    ops = StepOps(
        backward=lambda loss: loss.backward(),
        no_sync=contextlib.nullcontext,
        clip=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")),
    )
    assert ops.num_processes == 1
    x = torch.cat([b["x"] for b in window])
    grad = 2 * (x @ before.T).T @ x / 3  # d/dw of the mean over 3 rows of (x.w)^2
    meter = _Recorder()
    norm = window_step(_SquaredSum(), model, optimizer, window, 3, meter, ops, before_forward=seen.append)
    assert seen == window
    assert [b for _, b in meter.added] == window
    assert model.weight.grad is None  # zeroed with set_to_none after the step
    torch.testing.assert_close(model.weight.detach(), before - 0.5 * grad)
    assert norm.item() == pytest.approx(grad.norm().item(), rel=1e-6)


def test_the_meter_s_line_is_the_step_s_mean_loss_and_counts():
    logger = _Logger()
    meter = _meter(loggers=[logger])
    meter.start()
    meter.add(torch.tensor(3.0), _classification_batch(2, 4, padding=3))
    meter.add(torch.tensor(6.0), _classification_batch(4, 5))
    record = meter.end_step(1, lr=torch.tensor(0.25), grad_norm=torch.tensor(2.5))
    assert record["train/loss"] == 9.0 / 6  # summed losses over the step's 6 samples
    assert (record["step"], record["lr"], record["grad_norm"]) == (1, 0.25, 2.5)
    assert type(record["lr"]) is float and type(record["grad_norm"]) is float
    assert (record["train/samples"], record["train/tokens"]) == (6, 2 * 4 + 4 * 5)
    assert record["speed/step_s"] == meter.step_times[-1] >= 0
    assert record["mem/current_bytes"] == meter.read_memory()
    assert logger.lines == [(1, record)]
    # the window was reset: the next step counts only its own micro-batch
    meter.add(torch.tensor(1.0), _classification_batch(4, 1))
    record = meter.end_step(2, lr=0.5, grad_norm=None)
    assert record["train/loss"] == 0.25 and record["grad_norm"] is None
    assert (record["train/samples"], record["train/tokens"]) == (10, 32)
    assert [step for step, _ in logger.lines] == [1, 2]
    summary = meter.summary()
    assert summary["train/loss"] == 0.25
    assert summary["train/loss_mean"] == (1.5 + 0.25) / 2
    assert (summary["train/steps"], summary["train/samples"], summary["train/tokens"]) == (2, 10, 32)
    assert summary["train/resumed_from_step"] == 0


def test_a_causal_step_is_the_mean_over_real_target_tokens():
    meter = _meter(task=CausalLM())
    meter.start()
    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    meter.add(torch.tensor(6.0), {"labels": labels, "attention_mask": (labels != -100).long()})
    record = meter.end_step(1, lr=1.0, grad_norm=0.0)
    assert record["train/loss"] == 6.0 / 3  # 3 real targets (2 rows, 5 real tokens)
    # a causal LM's train/tokens are the tokens it trains on: its real targets
    assert (record["train/samples"], record["train/tokens"]) == (2, 3)


def test_only_the_main_process_logs_and_a_non_finite_loss_stops_the_run():
    logger = _Logger()
    quiet = _meter(loggers=[logger], is_main=False)
    quiet.start()
    quiet.add(torch.tensor(1.0), _classification_batch(1, 1))
    quiet.end_step(1, 0.1, 1.0)
    quiet.log({"eval/loss": 1.0}, 1)
    assert logger.lines == []
    loud = _meter(loggers=[logger])
    loud.log({"eval/loss": 2.0}, 7)
    assert logger.lines == [(7, {"eval/loss": 2.0})]
    loud.start()
    for loss in (math.nan, math.inf):
        loud.add(torch.tensor(loss), _classification_batch(1, 1))
        with pytest.raises(TrainingDiverged, match=rf"^train/loss is {loss} at optimizer step 4$"):
            loud.end_step(4, 0.1, 1.0)
    assert len(logger.lines) == 1  # a diverged step writes no line


def test_a_resumed_meter_continues_the_counts_and_the_loss_mean():
    meter = _meter()
    meter.restore(step=3, samples=30, tokens=300, last_loss=0.5, loss_total=4.5)
    assert (meter.samples, meter.tokens, meter.last_loss) == (30, 300, 0.5)
    meter.start()
    meter.add(torch.tensor(2.0), _classification_batch(4, 10))
    meter.end_step(4, 0.1, 1.0)
    summary = meter.summary()
    assert summary["train/loss_mean"] == (4.5 + 0.5) / 4  # 3 restored steps and this one
    assert (summary["train/steps"], summary["train/resumed_from_step"]) == (4, 3)
    assert (summary["train/samples"], summary["train/tokens"]) == (34, 340)
    # speeds over this process's work only: 4 samples, 40 tokens in its one step
    assert summary["speed/samples_per_s"] == 4 / summary["speed/train_s"]
    assert summary["speed/tokens_per_s"] == 40 / summary["speed/train_s"]
    # a checkpoint without the total (older layout) keeps the mean unknown, never a wrong number
    old = _meter()
    old.restore(step=3, samples=30, tokens=300, last_loss=0.5)
    assert math.isnan(old.loss_total)


def test_the_summary_s_times_from_known_step_times():
    meter = _meter()
    meter.step_times = [5.0, 1.0, 2.0, 9.0, 3.0, 4.0]
    meter.untimed = {3}
    meter.samples, meter.tokens = 12, 120
    summary = meter.summary()
    assert summary["speed/train_s"] == 24.0
    assert summary["speed/step_s_median"] == 3.0  # [5, 1, 2, 3, 4] less the first 2 steps
    assert summary["speed/first_step_overhead_s"] == 5.0 - 3.0
    assert summary["speed/tracked_step_s"] == 9.0
    assert summary["speed/samples_per_s"] == 12 / 24 and summary["speed/tokens_per_s"] == 5.0
    assert summary["train/steps"] == 6
    short = _meter()
    short.step_times = [4.0, 2.0]  # too few for the warm-up rule: all but the first
    assert short.summary()["speed/step_s_median"] == 2.0
    assert short.summary()["speed/tracked_step_s"] is None
    one = _meter()
    one.step_times = [4.0]
    assert one.summary()["speed/step_s_median"] == 4.0
    none = _meter().summary()
    assert math.isnan(none["train/loss"])  # no step yet: not a number, never None
    assert math.isnan(none["speed/step_s_median"]) and math.isnan(none["train/loss_mean"])
    assert math.isnan(none["speed/samples_per_s"]) and math.isnan(none["speed/first_step_overhead_s"])
    assert none["speed/tracked_step_s"] is None and none["train/steps"] == 0
    untracked = _meter()
    untracked.step_times, untracked.untimed = [1.0], {5}  # tracking never reached its step
    assert untracked.summary()["speed/tracked_step_s"] is None


def test_only_the_main_process_shows_a_progress_bar_and_only_when_asked():
    assert _meter(progress_bar=False, is_main=True)._progress is None
    assert _meter(progress_bar=True, is_main=False)._progress is None
    shown = _meter(progress_bar=True, is_main=True)
    assert shown._progress is not None
    shown.close()


def test_the_step_clock_excludes_other_work_and_startup_counts_from_the_process():
    meter = _meter()
    assert not meter.started
    meter.start()
    assert meter.started
    assert meter.startup_s == pytest.approx(time.time() - psutil.Process().create_time(), abs=0.5)
    assert process_started() == psutil.Process().create_time()
    first = meter.startup_s
    meter.start()  # a second start (after an evaluation) keeps the process's startup
    assert meter.startup_s == first
    meter.exclude(1000.0)  # an evaluation of 1000 s: not the step's time
    meter.add(torch.tensor(1.0), _classification_batch(1, 1))
    meter.end_step(1, 0.1, 1.0)
    assert -1000.0 < meter.step_times[0] < -999.0
    meter.leave_untimed()
    assert meter.untimed == {1}
