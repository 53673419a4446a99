"""The ``accelerate`` backend: an ``Accelerator`` loop over accumulation windows.

Micro-batches are taken one optimizer step (window) at a time, so the loss can be normalized by
the task's items (samples, or real target tokens) in the whole step before any backward pass; gradients are synchronized
once per window (``no_sync`` on every micro-batch but the last). Evaluation is shared code: the
backend leaves the prepared model, eval loader and accelerator on the job.
"""

from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import TorchDynamoPlugin

from effitrain.training import accumulation_windows, step_items, window_step


def make_accelerator(cfg) -> Accelerator:
    dynamo = (
        TorchDynamoPlugin(backend=cfg.compile.backend, mode=cfg.compile.mode) if cfg.compile.enabled else None
    )
    # No accumulation plugin: effitrain cuts the windows itself (the last of an epoch may be
    # shorter) and normalizes the loss by the whole step's samples, as accelerate's
    # variable-window example does; backward() then never divides by a fixed step count.
    return Accelerator(mixed_precision=cfg.precision.mixed_precision, dynamo_plugin=dynamo)


def fit(job) -> dict:
    cfg, meter = job.cfg, job.meter
    accelerator = make_accelerator(cfg)
    model, optimizer, train_loader = accelerator.prepare(job.model, job.optimizer, job.train_loader)
    job.eval_model, job.eval_loader, job.accelerator = (
        model,
        accelerator.prepare(job.eval_loader),
        accelerator,
    )
    scheduler = job.scheduler  # stepped by hand once per optimizer step, not per process
    max_norm = cfg.max_grad_norm or float("inf")  # inf: measure the norm without clipping

    start = job.checkpoints.restore()  # step 0 unless resuming

    model.train()
    meter.start()
    step, epoch = start.step, start.epoch
    while step < job.num_steps:
        batches = job.checkpoints.epoch_batches(train_loader, epoch)
        for window in accumulation_windows(batches, cfg.gradient_accumulation_steps):
            with job.track_step(step + 1):
                lr = optimizer.param_groups[0]["lr"]
                grad_norm = window_step(
                    job.task, model, optimizer, window, step_items(job.task, window, accelerator.device),
                    accelerator.num_processes, meter, accelerator.backward,
                    lambda: accelerator.no_sync(model),
                    lambda: accelerator.clip_grad_norm_(model.parameters(), max_norm),
                    job.step_memory.saw,
                )  # fmt: skip
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
            step += 1
            meter.end_step(step, lr, grad_norm)
            job.after_step(step)  # eval_every, then the checkpoint
            if step >= job.num_steps:
                break
        epoch += 1
    return meter.summary()
