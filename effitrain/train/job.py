"""What a backend receives (:class:`Job`), what it gives back for evaluation (:class:`Evaluation`),
and the shared evaluation.

Everything a backend needs is built once, by :func:`effitrain.run.build.build_job`; the backend owns only its
loop (:class:`effitrain.backends.Backend`).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import DictConfig

from effitrain.train import checkpoint, resume_point
from effitrain.train.step import StepMeter, epoch_batches
from effitrain.train.tasks import Task


class StepTracking(Protocol):
    """What the loop asks of the step tracker (:class:`effitrain.memory.replay.StepMemory`, built by the
    run above this layer): declared here, so this layer names no class of a higher one."""

    batches: list  # the shapes of the tracked step's micro-batches, as the replay needs them

    def track(self, step: int) -> AbstractContextManager: ...

    def saw(self, batch: dict) -> None: ...

    def end(self) -> None: ...

    def summary(self) -> dict: ...


class RunMemory(Protocol):
    """What the run reads of the measured region (:class:`effitrain.memory.track.TrainingMemory`)."""

    def __enter__(self) -> RunMemory: ...

    def __exit__(self, *exc) -> None: ...

    def summary(self) -> dict: ...


@dataclass(frozen=True)
class Evaluation:
    """What the shared evaluation runs on, as the backend prepared it: the model (wrapped or compiled
    by the backend, or the plain module), the eval loader (sharded over processes) and the
    accelerator that gathers the metrics over processes."""

    model: torch.nn.Module
    loader: torch.utils.data.DataLoader
    accelerator: object


@dataclass
class Job:
    """What a backend receives: the objects the shared code built, the config they came from, and the
    run's shared steps.

    A backend owns only its loop; the run's lifecycle around it is shared. Before the loop the shared
    code restores the resume point (``start``); each optimizer step of the loop runs inside
    ``with job.track_step(step):`` (all its micro-batches, clipping and the optimizer step) and is
    followed by ``job.end_step(...)``; the backend's micro-batches of an epoch come from
    :meth:`epoch_batches` (a resumed epoch skips what was consumed).

    ``model`` stays the plain module: backends wrap it (DDP, torch.compile) without copying its
    parameters, so after training it holds the trained weights, and saving it gives keys without
    an ``_orig_mod.`` prefix. Backends fill in nothing: what evaluation runs on, they return
    (:class:`Evaluation`) or hand to :meth:`end_step`.
    """

    cfg: DictConfig
    task: Task  # loss, items, evaluation: the hooks backends call (job.task.loss_sum, ...)
    model: torch.nn.Module
    tokenizer: object
    train_loader: torch.utils.data.DataLoader
    eval_loader: torch.utils.data.DataLoader
    optimizer: torch.optim.Optimizer
    scheduler: object
    num_steps: int
    meter: StepMeter
    output_dir: Path
    checkpoints: checkpoint.Checkpointer
    # the memory tracker: measures one chosen optimizer step inside track_step; None: no tracking
    step_memory: StepTracking | None
    data_keys: dict  # summary keys describing the tokenized data (the task's)
    memory: RunMemory  # everything mem/* of the run, read around the measured region
    resume: resume_point.ResumePoint | None = None  # the checkpoint this run continues from
    # where the loop starts: set by :meth:`restore` before the backend's fit
    start: resume_point.Position = field(default_factory=lambda: resume_point.Position(0, 0, 0))
    # optimizer_in_backward=true: the optimizer's update runs in backward; its norm() is the step's
    # gradient norm (the gradients are freed before a clip could read them); None: off
    in_backward: object = None
    # (position, generators) the data order resumes from, when the job restored the weights itself
    _data_resume: tuple[resume_point.Position, dict] | None = None

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        """However training ended: no memory tracker left active, the progress bar closed."""
        if self.step_memory is not None:
            self.step_memory.end()  # a step that failed while tracked leaves no dispatch mode behind
        self.meter.close()

    def restore(self, weights: bool) -> None:
        """Where the loop starts: the resume point's counts, and with ``weights`` its weights,
        optimizer, scheduler and data order too (``False``: a backend that loads them itself, the
        Trainer)."""
        self.start = self.checkpoints.restore(weights=weights)
        if self.resume is not None and weights:
            self._data_resume = (self.start, self.resume.rng_state())

    @contextlib.contextmanager
    def track_step(self, step: int):
        """The context of optimizer step ``step`` (1-based): the meter's clock starts as the first
        step begins (so a backend's set-up is nobody's step time), and the memory tracker measures
        the step it chose."""
        if not self.meter.started:
            self.meter.start()
        with self.step_memory.track(step) if self.step_memory is not None else contextlib.nullcontext():
            yield

    def end_step(self, step: int, lr: float, grad_norm, evaluation: Evaluation, trainer_state=None) -> None:
        """The shared end of optimizer step ``step``, in this order: the meter's line (which raises
        on a diverged loss), an evaluation on ``evaluation`` when ``eval_every`` says so (its time
        left out of the next step's), then the checkpoint, so a diverged state is never saved.
        ``trainer_state``: the Trainer's own state, saved with the checkpoint for its resume."""
        self.meter.end_step(step, lr, grad_norm)
        every = self.cfg.get("eval_every")
        if every and step % every == 0 and step < self.num_steps:  # the last step: the final evaluation
            started = self.meter.clock()
            self.log_evaluation(step, evaluate_job(self, evaluation))
            self.meter.exclude(self.meter.clock() - started)
        self.checkpoints.after_step(step, trainer_state=trainer_state)

    def epoch_batches(self, loader, epoch: int):
        """``epoch``'s micro-batches; in the epoch being resumed, the consumed ones are skipped and the
        generators then restored (:func:`effitrain.train.step.epoch_batches`)."""
        pending, self._data_resume = self._data_resume, None
        if pending is None or pending[0].epoch != epoch:
            return epoch_batches(loader, epoch)
        at, rng = pending
        return epoch_batches(loader, epoch, at.batches, rng)

    def log_evaluation(self, step: int, metrics: dict) -> None:
        self.meter.log_evaluation(step, metrics)


def evaluate_job(job: Job, evaluation: Evaluation) -> dict:
    """The shared evaluation of ``job``'s task, on what the backend prepared."""
    return job.task.evaluate(evaluation.model, evaluation.loader, evaluation.accelerator)
