"""The ``accelerate`` backend: an ``Accelerator`` loop over accumulation windows.

Micro-batches are taken one optimizer step (window) at a time, so the loss can be normalized by
the task's items (samples, or real target tokens) in the whole step before any backward pass;
gradients are synchronized once per window (``no_sync`` on every micro-batch but the last), as
accelerate's own variable-window example (gradient_accumulation_for_autoregressive_models.py) does.
Restoring, the meter, the end of a step and evaluation are the run's shared code
(:class:`effitrain.train.job.Job`); ``fit`` returns the prepared model, eval loader and accelerator that
evaluation runs on (:class:`effitrain.train.job.Evaluation`).
"""

from __future__ import annotations

from functools import partial

from accelerate import Accelerator
from accelerate.utils import TorchDynamoPlugin

from effitrain.train.job import Evaluation
from effitrain.train.sharding import full_value, gradient_sync_off, is_sharded
from effitrain.train.step import StepOps, accumulation_windows, step_items, window_step

loads_checkpoint = False  # the shared restore loads weights, optimizer, scheduler and generators


def make_accelerator(cfg) -> Accelerator:
    dynamo = (
        TorchDynamoPlugin(backend=cfg.compile.backend, mode=cfg.compile.mode) if cfg.compile.enabled else None
    )
    # No accumulation plugin: effitrain cuts the windows itself (the last of an epoch may be
    # shorter) and normalizes the loss by the whole step's samples, as accelerate's
    # variable-window example does; backward() then never divides by a fixed step count.
    return Accelerator(mixed_precision=cfg.precision.mixed_precision, dynamo_plugin=dynamo)


def fit(job) -> Evaluation:
    """Train ``job`` from ``job.start`` to ``job.num_steps`` optimizer steps."""
    cfg = job.cfg
    accelerator = make_accelerator(cfg)
    if is_sharded(job.model):
        # sharded already (effitrain.train.sharding, one code path with the prediction): accelerate
        # must not wrap it in DDP; FSDP2's own policy casts it for mixed precision
        model = job.model
        optimizer, train_loader = accelerator.prepare(job.optimizer, job.train_loader)
    else:
        model, optimizer, train_loader = accelerator.prepare(job.model, job.optimizer, job.train_loader)
    evaluation = Evaluation(model, accelerator.prepare(job.eval_loader), accelerator)
    scheduler = job.scheduler  # stepped by hand once per optimizer step, not per process
    ops = step_ops(accelerator, model, cfg.max_grad_norm, job.in_backward)

    model.train()
    step, epoch = job.start.step, job.start.epoch
    while step < job.num_steps:
        for window in accumulation_windows(
            job.epoch_batches(train_loader, epoch), cfg.gradient_accumulation_steps
        ):
            with job.track_step(step + 1):
                # the value now: an lr held in a tensor (torchao's) is updated in place by the scheduler
                lr = float(optimizer.param_groups[0]["lr"])
                items = step_items(job.task, window, accelerator.device)
                grad_norm = window_step(
                    job.task, model, optimizer, window, items, job.meter, ops, job.step_memory.saw
                )
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
            step += 1
            job.end_step(step, lr, grad_norm, evaluation)
            if step >= job.num_steps:
                break
        epoch += 1
    return evaluation


def step_ops(accelerator: Accelerator, model, max_grad_norm: float | None, in_backward=None) -> StepOps:
    """One optimizer step's operations on the prepared ``model``: accelerate's backward, DDP's
    ``no_sync`` (FSDP2's for a sharded model), clipping, and the processes whose gradients DDP
    averages. Its own function so that two processes' step can be checked against one big batch's
    without a run (tests/train/test_distributed.py)."""
    no_sync = partial(gradient_sync_off, model) if is_sharded(model) else partial(accelerator.no_sync, model)
    max_norm = max_grad_norm or float("inf")  # inf: measure the norm without clipping
    return StepOps(
        backward=accelerator.backward,
        no_sync=no_sync,
        # over sharded gradients the norm is the whole model's, returned as a DTensor; with the
        # optimizer's update in backward, the norm its hooks took (no gradient is left to clip)
        clip=in_backward.norm
        if in_backward is not None
        else lambda: full_value(accelerator.clip_grad_norm_(model.parameters(), max_norm)),
        num_processes=accelerator.num_processes,
    )
