"""The ``transformers.Trainer`` backend, given effitrain's data order, loss, optimizer and scheduler.

The Trainer keeps its own loop (accumulation, clipping, compile, mixed precision, DDP); what
would make it differ from the accelerate backend is replaced:

* the train dataloader is effitrain's (same sampler, so the same batches in the same order);
* the loss is the task's summed loss divided by the task's items (samples, or real target tokens)
  of the whole optimizer step over all processes (``num_items_in_batch``, counted by the task, not
  by the Trainer's label rule), so accumulation equals one big batch; a plain Trainer takes the
  model's mean loss as already normalized and never divides by the accumulation steps;
* it reports nothing itself: a callback wraps each optimizer step in ``job.track_step`` and hands
  its end to the run's shared ``job.end_step`` (meter, evaluation, checkpoint).

It resumes through its own ``resume_from_checkpoint`` (effitrain's checkpoints use the Trainer's
file names), so the shared restore gives it only effitrain's counts (``loads_checkpoint``).
Evaluations during training run on the plain module; ``fit`` returns the Trainer's wrapped model for
the final one.
"""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback, TrainingArguments

from effitrain.train.job import Evaluation
from effitrain.train.step import step_items, step_loss

loads_checkpoint = True  # fit loads weights, optimizer, scheduler and generators (the Trainer's resume)


class _EffitrainTrainer(Trainer):
    loss_is_scaled_for_ga = True  # compute_loss below normalizes by the step's samples itself

    def __init__(self, *args, job, **kwargs):
        super().__init__(*args, **kwargs)
        self._job = job
        self.model_accepts_loss_kwargs = True

    def get_train_dataloader(self):
        return self.accelerator.prepare(self._job.train_loader)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # The Trainer counts labels != -100 by its own rules (shifted or not, by the model's loss
        # type); the task's count, the one the accelerate loop divides by, is what it must be.
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        return batches, step_items(self._job.task, batches, device) if batches else None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._job.step_memory.saw(inputs)
        micro_loss = self._job.task.loss_sum(model, inputs)
        self._job.meter.add(micro_loss, inputs)
        loss = step_loss(micro_loss, num_items_in_batch, self.accelerator.num_processes)
        return (loss, None) if return_outputs else loss


class _StepCallback(TrainerCallback):
    """Each optimizer step runs inside ``job.track_step(step)``: entered at ``on_step_begin`` (after
    the step's micro-batches were fetched), left at ``on_step_end`` (after the optimizer and
    scheduler steps), the same span as the accelerate loop's ``with``. The step's end
    (``logging_steps=1`` logs every one) goes to the shared ``job.end_step``, with ``evaluation``:
    what an evaluation during training runs on."""

    def __init__(self, job, evaluation: Evaluation):
        self.job = job
        self.evaluation = evaluation
        self._window: contextlib.ExitStack | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._window = contextlib.ExitStack()
        self._window.enter_context(self.job.track_step(state.global_step + 1))

    def on_step_end(self, args, state, control, **kwargs):
        self.leave(None)

    def leave(self, error: BaseException | None) -> None:
        """Leave the open step's context; ``error``: the exception that ends training inside it."""
        window, self._window = self._window, None
        if window is not None:
            window.__exit__(type(error) if error else None, error, error.__traceback__ if error else None)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "grad_norm" in logs:
            self.job.end_step(
                state.global_step,
                logs["learning_rate"],
                logs["grad_norm"],
                self.evaluation,
                trainer_state=state,
            )


def training_arguments(cfg, num_steps: int, output_dir) -> TrainingArguments:
    precision = cfg.precision.mixed_precision
    return TrainingArguments(
        output_dir=str(output_dir / "trainer"),
        per_device_train_batch_size=cfg.micro_batch_size,
        per_device_eval_batch_size=cfg.eval_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_steps=num_steps,
        max_grad_norm=cfg.max_grad_norm,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        torch_compile=cfg.compile.enabled,
        torch_compile_backend=cfg.compile.backend if cfg.compile.enabled else None,
        torch_compile_mode=cfg.compile.mode if cfg.compile.enabled else None,
        seed=cfg.seed,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        average_tokens_across_devices=True,
        use_cpu=not torch.cuda.is_available(),
    )


def fit(job) -> Evaluation:
    """Train ``job`` with a ``Trainer``, resumed by the Trainer itself from ``job.resume``."""
    cfg = job.cfg
    trainer = _EffitrainTrainer(
        model=job.model,
        args=training_arguments(cfg, job.num_steps, job.output_dir),
        optimizers=(job.optimizer, job.scheduler),
        job=job,
    )
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)  # the shared meter draws the progress bar
    # evaluations during training (eval_every) run on the plain module, with the Trainer's accelerator
    eval_loader = trainer.accelerator.prepare(job.eval_loader)
    steps = _StepCallback(job, Evaluation(job.model, eval_loader, trainer.accelerator))
    trainer.add_callback(steps)

    # The Trainer loads weights, optimizer, scheduler and generators from effitrain's checkpoint
    # (its file names are the Trainer's) and skips the consumed batches itself.
    resume = str(job.resume.folder) if job.resume is not None else None
    try:
        trainer.train(resume_from_checkpoint=resume)
    except BaseException as error:  # a step that fails inside track_step leaves its context too
        steps.leave(error)
        raise
    finally:  # the Trainer makes its output folder; effitrain saves nothing there: no empty folder left
        with contextlib.suppress(OSError):
            os.rmdir(trainer.args.output_dir)
    return Evaluation(trainer.model_wrapped, eval_loader, trainer.accelerator)
