"""What both backends share inside the loop: accumulation windows, the step's loss normalization, the
step meter. The task (effitrain.train.tasks) supplies the loss, the items that normalize it and evaluation.

A backend owns only its loop; the numbers it reports are computed here, so a comparison never
depends on which backend ran.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

import torch

from effitrain.config.summary_schema import WARMUP_STEPS  # steps left out of the steady step time
from effitrain.train.distributed import all_reduce_sum
from effitrain.util.interrupts import raise_if_interrupted


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite."""


def accumulation_windows(dataloader, steps: int):
    """Group micro-batches into optimizer steps of ``steps`` micro-batches (the last may be shorter)."""
    iterator = iter(dataloader)
    while window := list(islice(iterator, steps)):
        yield window


def epoch_batches(loader, epoch: int, skip: int = 0, rng_state: dict | None = None):
    """An iterator over ``epoch``'s micro-batches. Resuming inside the epoch, the ``skip`` consumed
    ones are drawn and dropped, then the generators are set to ``rng_state`` (the checkpoint's),
    so every later draw (dropout, the next epoch's loader) matches the uninterrupted run."""
    loader.set_epoch(epoch)  # accelerate's loader forwards this to the sampler
    batches = iter(loader)  # creating the loader's iterator draws from torch's generator
    for _ in range(skip):
        next(batches)
    if rng_state is not None:
        from effitrain.train.rng import set_rng_state

        set_rng_state(rng_state)
    return batches


def step_loss(micro_loss: torch.Tensor, step_items: int, num_processes: int) -> torch.Tensor:
    """The micro-batch's share of its optimizer step's loss: its summed loss over the items (the task's
    samples or real target tokens) of the whole step, over all processes, times the processes (DDP averages their gradients), so
    the step's gradient is that of one big batch's mean loss. Both backends use it."""
    return micro_loss * num_processes / step_items


@dataclass(frozen=True)
class StepOps:
    """The backend's operations in one optimizer step (:func:`window_step`).

    ``backward(loss)``; ``no_sync()``: a context for every micro-batch but the last, so DDP syncs
    once per step; ``clip()``: clips the gradients and returns their norm; ``num_processes``: the
    processes whose gradients DDP averages (:func:`step_loss`).
    """

    backward: Callable[[torch.Tensor], None]
    no_sync: Callable[[], contextlib.AbstractContextManager]
    clip: Callable[[], object]
    num_processes: int = 1


def window_step(task, model, optimizer, window, step_items: int, meter, ops: StepOps, before_forward=None):
    """One optimizer step over ``window`` (its micro-batches): forward, backward, clip, step, zero;
    ``task.loss_sum`` gives each micro-batch's summed loss.

    ``ops`` (backward, no_sync, clip) come from the backend; the memory prediction runs this same
    function on fake tensors, so what it predicts is what this step allocates. ``before_forward(batch)``
    is called as each micro-batch starts (the memory tracker's hook).
    """
    for index, batch in enumerate(window):
        last = index == len(window) - 1
        if before_forward is not None:
            before_forward(batch)
        with contextlib.nullcontext() if last else ops.no_sync():
            micro_loss = task.loss_sum(model, batch)
            meter.add(micro_loss, batch)
            ops.backward(step_loss(micro_loss, step_items, ops.num_processes))
    grad_norm = ops.clip()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def step_items(task, window, device) -> int:
    """The items (``task.num_items``: samples, or real target tokens) of one optimizer step, over
    all processes: what its summed loss is divided by."""
    return int(all_reduce_sum([sum(int(task.num_items(b)) for b in window)], device)[0])


def process_started() -> float:
    """When this process was created (``time.time()`` scale), as the OS recorded it."""
    import psutil

    return psutil.Process().create_time()


class StepMeter:
    """Per-optimizer-step bookkeeping shared by both backends: loss, counts, time, the progress bar.

    ``add`` is called per micro-batch, ``end_step`` once per optimizer step; ``end_step`` writes
    one line to every logger and raises :class:`TrainingDiverged` on a non-finite loss.
    """

    def __init__(self, num_steps: int, loggers: list, device, progress_bar: bool, is_main: bool, task,
                 read_memory=lambda: None, clock=time.perf_counter):  # fmt: skip
        self.task = task  # what normalizes the loss and what counts as a token
        self.clock = clock  # seconds, monotonic; a test gives its own to check the arithmetic exactly
        self.loggers = loggers if is_main else []
        self.device = device
        self.read_memory = read_memory  # memory in use now (the run's PeakMemory.read_current)
        self.step_times: list[float] = []
        self.untimed: set[int] = set()  # indices of steps whose time says nothing (the memory-tracked one)
        self.samples = 0
        self.tokens = 0
        self.last_loss = math.nan
        self.loss_total = 0.0  # sum of every optimizer step's loss, for train/loss_mean
        self.best_eval: tuple[float, int] | None = None  # (eval/loss, step) of the best evaluation so far
        self.resumed = {"step": 0, "samples": 0, "tokens": 0}  # counts of the run this one resumes
        self._reset_window()
        self._started: float | None = None
        self.startup_s = None
        self._progress = None
        if progress_bar and is_main:
            from tqdm.auto import tqdm

            self._progress = tqdm(total=num_steps, desc="train", unit="step", dynamic_ncols=True)

    def _reset_window(self):
        self._loss_sum = 0.0
        self._samples = 0
        self._items = 0
        self._tokens = 0

    @property
    def started(self) -> bool:
        return self._started is not None

    def start(self) -> None:
        if self.startup_s is None:  # from the process's creation: interpreter, imports, data, model
            # before the clock starts: importing psutil would otherwise count as the first step's time
            self.startup_s = time.time() - process_started()
        self._started = self._last = self.clock()

    def add(self, micro_loss_sum: torch.Tensor, batch) -> None:
        # tensors stay on the device: read once per optimizer step, never per micro-batch (a GPU sync)
        self._loss_sum = self._loss_sum + micro_loss_sum.detach()
        self._samples += len(batch["labels"])
        self._items = self._items + self.task.num_items(batch)
        self._tokens = self._tokens + self.task.num_tokens(batch)

    def end_step(self, step: int, lr: float, grad_norm) -> dict:
        raise_if_interrupted()  # a SIGTERM or Ctrl-C whose first raise Python dropped
        loss_sum, samples, items, tokens = all_reduce_sum(
            [float(self._loss_sum), self._samples, float(self._items), float(self._tokens)], self.device
        )
        self._reset_window()
        now = self.clock()
        self.step_times.append(now - self._last)
        self._last = now
        self.samples += int(samples)
        self.tokens += int(tokens)
        self.last_loss = loss_sum / items  # the mean over the step's samples or real target tokens
        self.loss_total += self.last_loss
        record = {
            "step": step,
            "train/loss": self.last_loss,
            "lr": float(lr),
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "train/samples": self.samples,
            "train/tokens": self.tokens,
            "speed/step_s": self.step_times[-1],
            "mem/current_bytes": self.read_memory(),
        }
        if not math.isfinite(self.last_loss):
            raise TrainingDiverged(f"train/loss is {self.last_loss} at optimizer step {step}")
        for logger in self.loggers:
            logger.log_dict(record, step)
        if self._progress is not None:
            elapsed = now - self._started
            self._progress.set_postfix(
                loss=f"{self.last_loss:.4f}", samples_per_s=f"{self.samples / elapsed:.1f}"
            )
            self._progress.update(1)
        return record

    def leave_untimed(self) -> None:
        """The step being measured now is tracked for memory: its time stays out of the medians."""
        self.untimed.add(len(self.step_times))

    def log(self, record: dict, step: int) -> None:
        """A record that is not a training step's (an evaluation), to the same loggers."""
        for logger in self.loggers:
            logger.log_dict(record, step)

    def log_evaluation(self, step: int, metrics: dict) -> None:
        """An evaluation's record, to every logger; the best so far is kept (and checkpointed)."""
        self.log({"step": step, **metrics}, step)
        loss = metrics["eval/loss"]
        if math.isfinite(loss) and (self.best_eval is None or loss < self.best_eval[0]):
            self.best_eval = (loss, step)

    def exclude(self, seconds: float) -> None:
        """Time spent since the last step on something else (an evaluation): not the next step's."""
        self._last += seconds

    def restore(
        self, step: int, samples: int, tokens: int, last_loss: float, loss_total: float = math.nan,
        best_eval: list | None = None,
    ) -> None:  # fmt: skip
        """Continue the counts of a resumed run (its best evaluation too); speeds cover only the steps
        run in this process."""
        self.resumed = {"step": step, "samples": samples, "tokens": tokens}
        self.samples, self.tokens, self.last_loss = samples, tokens, last_loss
        self.loss_total = loss_total
        self.best_eval = tuple(best_eval) if best_eval is not None else None
        if self._progress is not None:
            self._progress.update(step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()

    def summary(self) -> dict:
        train_s = sum(self.step_times)
        timed = [t for i, t in enumerate(self.step_times) if i not in self.untimed]
        steady = timed[WARMUP_STEPS:] or timed[1:] or timed
        median = statistics.median(steady) if steady else math.nan
        samples, tokens = self.samples - self.resumed["samples"], self.tokens - self.resumed["tokens"]
        steps = self.resumed["step"] + len(self.step_times)
        return {
            "train/loss": self.last_loss,
            # the mean over all optimizer steps (the Trainer's train_loss): the figure to compare
            "train/loss_mean": self.loss_total / steps if steps else math.nan,
            "train/steps": steps,
            "train/samples": self.samples,
            "train/tokens": self.tokens,
            "train/resumed_from_step": self.resumed["step"],
            "speed/samples_per_s": samples / train_s if train_s else math.nan,
            "speed/tokens_per_s": tokens / train_s if train_s else math.nan,
            "speed/step_s_median": median,
            # the first step's extra time: compilation where compile is on, allocator and library
            # warm-up everywhere (so not a compile time: that is speed/compile_s)
            "speed/first_step_overhead_s": self.step_times[0] - median if self.step_times else math.nan,
            "speed/train_s": train_s,
            "speed/startup_s": self.startup_s,
            # the memory-tracked step (MemTracker's dispatch overhead included); null when none ran
            "speed/tracked_step_s": next(
                (self.step_times[i] for i in self.untimed if i < len(self.step_times)), None
            ),
        }
