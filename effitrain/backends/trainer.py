"""The ``transformers.Trainer`` backend, given effitrain's data order, loss, optimizer and scheduler.

The Trainer keeps its own loop (accumulation, clipping, compile, mixed precision, DDP); what
would make it differ from the accelerate backend is replaced:

* the train dataloader is effitrain's (same sampler, so the same batches in the same order);
* the loss is the task's summed loss divided by the task's items (samples, or real target tokens)
  of the whole optimizer step over all processes (``num_items_in_batch``, counted by the task, not
  by the Trainer's label rule), so accumulation equals one big batch;
* it reports nothing itself: a callback hands each step to effitrain's shared meter.
"""

from __future__ import annotations

import torch
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback, TrainingArguments

from effitrain.training import step_items, step_loss


class _EffitrainTrainer(Trainer):
    loss_is_scaled_for_ga = True  # compute_loss below normalizes by the step's samples itself

    def __init__(self, *args, task, train_loader, meter, step_memory, **kwargs):
        super().__init__(*args, **kwargs)
        self._task = task
        self._effitrain_train_loader = train_loader
        self._meter = meter
        self._step_memory = step_memory
        self.model_accepts_loss_kwargs = True

    def get_train_dataloader(self):
        return self.accelerator.prepare(self._effitrain_train_loader)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # The Trainer counts labels != -100 by its own rules (shifted or not, by the model's loss
        # type); the task's count, the one the accelerate loop divides by, is what it must be.
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        return batches, step_items(self._task, batches, device) if batches else None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._step_memory.saw(inputs)
        micro_loss = self._task.loss_sum(model, inputs)
        self._meter.add(micro_loss, inputs)
        loss = step_loss(micro_loss, num_items_in_batch, self.accelerator.num_processes)
        return (loss, None) if return_outputs else loss


class _StepCallback(TrainerCallback):
    """Each optimizer step (logging_steps=1 logs every one): the shared meter, then the checkpoint,
    in the accelerator loop's order, so a diverged state (end_step raises) is never saved."""

    def __init__(self, job):
        self.meter = job.meter
        self.job = job
        self.step_memory = job.step_memory

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_memory.begin(state.global_step + 1)  # tracks only the chosen step

    def on_step_end(self, args, state, control, **kwargs):
        self.step_memory.end()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "grad_norm" in logs:
            self.meter.end_step(state.global_step, logs["learning_rate"], logs["grad_norm"])
            self.job.after_step(state.global_step, trainer_state=state)


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


def fit(job) -> dict:
    cfg = job.cfg
    trainer = _EffitrainTrainer(
        model=job.model,
        args=training_arguments(cfg, job.num_steps, job.output_dir),
        optimizers=(job.optimizer, job.scheduler),
        task=job.task,
        train_loader=job.train_loader,
        meter=job.meter,
        step_memory=job.step_memory,
        callbacks=[_StepCallback(job)],
    )
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)  # the shared meter draws the progress bar

    # The Trainer loads weights, optimizer, scheduler and generators from effitrain's checkpoint
    # (its file names are the Trainer's) and skips the consumed batches itself.
    job.accelerator = trainer.accelerator  # evaluations during training (eval_every) use it
    job.eval_loader = trainer.accelerator.prepare(job.eval_loader)
    job.checkpoints.restore(weights=False)
    resume = str(job.checkpoints.resume_from) if job.checkpoints.resume_from else None
    job.meter.start()
    trainer.train(resume_from_checkpoint=resume)
    job.eval_model = trainer.model_wrapped
    return job.meter.summary()
