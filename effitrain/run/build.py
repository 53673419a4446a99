"""The run's job: everything a backend needs, built once in shared code (:func:`build_job`)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from effitrain.config.techniques import OPTIMIZER_IN_BACKWARD, apply_techniques
from effitrain.memory.step_peak import StepMemory
from effitrain.memory.track import TrainingMemory
from effitrain.train import checkpoint, resume_point
from effitrain.train.adapters.build import apply_adapter
from effitrain.train.adapters.configs import quantization_config
from effitrain.train.data import build_dataloaders, tokenize_cached
from effitrain.train.distributed import world_size
from effitrain.train.job import Job
from effitrain.train.modeling import build_tokenizer
from effitrain.train.optim import build_optimizer, build_scheduler, num_optimizer_steps
from effitrain.train.parallel import strategy_of
from effitrain.train.step import StepMeter
from effitrain.train.tasks import build_task


def build_job(cfg: DictConfig, output_dir: Path, loggers: list, device: torch.device, is_main: bool,
              resume: resume_point.ResumePoint | None = None) -> Job:  # fmt: skip
    """Build data, model, optimizer, scheduler, meter and checkpointer for ``cfg`` (validated already)."""
    from datasets.utils import logging as datasets_logging
    from transformers import set_seed

    # the data library's bars (reading, tokenizing, saving the cache) follow progress_bar too
    (datasets_logging.enable_progress_bar if cfg.progress_bar else datasets_logging.disable_progress_bar)()
    say = announce if is_main else (lambda line: None)
    set_seed(cfg.seed)
    task = build_task(cfg)
    say(f"loading the data ({_choice(cfg, 'data')})")
    raw = task.load(cfg.data)
    tokenizer = build_tokenizer(cfg.model)
    source_key = OmegaConf.to_container(cfg.data, resolve=True)
    say(f"tokenizing at max_length={cfg.max_length}, or reading the tokenized cache")
    tokenized = tokenize_cached(raw, tokenizer, cfg.max_length, cfg.get("cache_dir"), source_key, task)
    train_loader, eval_loader, _ = build_dataloaders(
        tokenized, task.collator(tokenizer), cfg.micro_batch_size, cfg.eval_batch_size, cfg.seed
    )

    set_seed(cfg.seed)  # the head's initialization does not depend on how much data was read
    say(f"building the model ({_choice(cfg, 'model')})")
    quantization = quantization_config(cfg.get("adapter"), cfg.precision.mixed_precision)
    model = task.build_model(cfg.model, raw, tokenizer, quantization=quantization)
    apply_techniques(model, cfg)  # effitrain.config.techniques: what gradient_checkpointing=true does
    model = apply_adapter(model, cfg.get("adapter"), task)
    strategy = strategy_of(cfg)
    model = strategy.apply(model, cfg, device, say)  # before the optimizer: it holds what this makes
    optimizer = build_optimizer(cfg.optimizer, model, cfg.weight_decay)
    # optimizer_in_backward=true: the update runs in backward (effitrain.config.techniques.in_backward)
    in_backward = OPTIMIZER_IN_BACKWARD.attach(model, optimizer, cfg)

    batches_per_process = strategy.batches_per_process(len(train_loader), world_size())
    num_steps = num_optimizer_steps(
        batches_per_process, cfg.gradient_accumulation_steps, cfg.epochs, cfg.max_steps
    )
    scheduler = build_scheduler(cfg.lr_scheduler, optimizer, num_steps, cfg.warmup_ratio)
    say(plan_line(cfg, batches_per_process, num_steps, world_size()))
    memory = TrainingMemory(model, optimizer, device)
    meter = StepMeter(num_steps, loggers, device, cfg.progress_bar, is_main, task, memory.peak.read_current)
    data_keys = task.data_summary(raw, tokenized)
    checkpoints = checkpoint.Checkpointer(
        cfg, output_dir, model, optimizer, scheduler, meter, num_steps, batches_per_process, resume
    )
    # one representative step: the second of this process (the optimizer state exists by then and
    # the first step's one-off costs are behind), or the last when there are fewer
    first = resume.step + 1 if resume is not None else 1
    step_memory = StepMemory(model, optimizer, min(first + 1, num_steps), meter)
    return Job(
        cfg=cfg,
        task=task,
        model=model,
        tokenizer=tokenizer,
        train_loader=train_loader,
        eval_loader=eval_loader,
        optimizer=optimizer,
        scheduler=scheduler,
        num_steps=num_steps,
        meter=meter,
        output_dir=output_dir,
        checkpoints=checkpoints,
        step_memory=step_memory,
        data_keys=data_keys,
        memory=memory,
        resume=resume,
        in_backward=in_backward,
    )


def announce(line: str) -> None:
    """A start-up stage as it begins (rank 0): loading and tokenizing can take minutes."""
    print(f"effitrain: {line}", flush=True)


def _choice(cfg: DictConfig, group: str) -> str:
    hydra = cfg.get("hydra")
    return str(hydra.runtime.choices.get(group)) if hydra is not None else group


def plan_line(cfg: DictConfig, batches_per_process: int, num_steps: int, processes: int = 1) -> str:
    """How many optimizer steps the run takes and why: ``max_steps`` is a cap on what the epochs
    give, never a target. A step's samples: processes x accumulation x micro batch."""
    per_epoch = math.ceil(batches_per_process / cfg.gradient_accumulation_steps)
    each = f"{processes} processes x " if processes > 1 else ""
    steps = f"{num_steps} optimizer steps of {each}{cfg.gradient_accumulation_steps} x {cfg.micro_batch_size} samples"
    epochs = f"{cfg.epochs} epoch{'s' * (cfg.epochs != 1)} of {per_epoch} step{'s' * (per_epoch != 1)}"
    if not cfg.max_steps:
        return f"training: {steps} ({epochs})"
    if cfg.max_steps < per_epoch * cfg.epochs:
        return f"training: {steps} (max_steps={cfg.max_steps} cuts the {epochs})"
    return f"training: {steps} ({epochs}; max_steps={cfg.max_steps} is a cap, not reached)"
