"""The ``accelerate`` backend: an ``Accelerator`` loop with ``accumulate()``.

Micro-batches are taken one optimizer step (window) at a time, so the loss can be normalized
by the number of samples in the whole step before any backward pass.
"""

from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, TorchDynamoPlugin

from effitrain.training import accumulation_windows, count_samples, evaluate, loss_sum


def make_accelerator(cfg) -> Accelerator:
    dynamo = (
        TorchDynamoPlugin(backend=cfg.compile.backend, mode=cfg.compile.mode) if cfg.compile.enabled else None
    )
    return Accelerator(
        mixed_precision=cfg.precision.mixed_precision,
        # Windows are cut by effitrain, so the sync must not follow the dataloader's end.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        dynamo_plugin=dynamo,
    )


def fit(job) -> dict:
    cfg, meter = job.cfg, job.meter
    accelerator = make_accelerator(cfg)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        job.model, job.optimizer, job.train_loader, job.eval_loader
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
            samples = count_samples(window, accelerator.device)
            # accumulate() syncs after `gradient_accumulation_steps` micro-batches: make that this
            # window's length (the last window of an epoch may be shorter) and restart its count.
            accelerator.gradient_accumulation_steps = len(window)
            accelerator.step = 0
            # backward() divides by the window length and DDP averages over processes; undo
            # both so the gradient is that of the mean loss over the step's samples.
            scale = len(window) * accelerator.num_processes / samples
            for batch in window:
                with accelerator.accumulate(model):
                    micro_loss = loss_sum(model, batch)
                    meter.add(micro_loss, batch)
                    accelerator.backward(micro_loss * scale)
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
                    lr = optimizer.param_groups[0]["lr"]
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
            step += 1
            meter.end_step(step, lr, grad_norm)
            job.checkpoints.after_step(step)  # after end_step: a diverged state is never saved
            if step >= job.num_steps:
                break
        epoch += 1
    metrics = meter.summary()
    metrics.update(evaluate(model, eval_loader, accelerator))
    return metrics
