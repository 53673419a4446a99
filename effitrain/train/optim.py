"""Optimizer (decay / no-decay parameter groups), learning-rate schedule, and step counting."""

from __future__ import annotations

import math

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from effitrain.util.compat import batch_norm_classes


def _is_norm(module: torch.nn.Module) -> bool:
    norm_types = (torch.nn.LayerNorm, torch.nn.GroupNorm, *batch_norm_classes())
    return isinstance(module, norm_types) or "norm" in type(module).__name__.lower()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: everything else decays; biases and normalization weights do not.

    Parameters shared between modules (tied embeddings) appear once, in the group of their
    first owner, as ``named_parameters`` lists them.
    """
    no_decay_ids = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if name == "bias" or name.endswith("_bias") or _is_norm(module):
                no_decay_ids.add(id(param))
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if id(param) in no_decay_ids else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(optimizer_cfg: DictConfig, model: torch.nn.Module, weight_decay: float):
    """Instantiate the optimizer group's ``_target_`` (a partial) with effitrain's parameter groups."""
    # Plain lists, not ListConfig, in param_groups: the checkpoint is read back with weights_only=True.
    return instantiate(optimizer_cfg, _convert_="all")(param_groups(model, weight_decay))


def num_optimizer_steps(
    batches_per_epoch: int, gradient_accumulation_steps: int, epochs: int, max_steps=None
) -> int:
    """Optimizer steps of a run: ``ceil(batches / accumulation) * epochs``, capped by ``max_steps``."""
    steps = math.ceil(batches_per_epoch / gradient_accumulation_steps) * epochs
    return min(steps, max_steps) if max_steps else steps


def build_scheduler(scheduler_cfg, optimizer, num_training_steps: int, warmup_ratio: float):
    """The ``lr_scheduler`` group's schedule (a partial) with ``ceil(warmup_ratio * steps)`` warmup
    steps, counted in optimizer steps after accumulation."""
    warmup = math.ceil(warmup_ratio * num_training_steps)
    return instantiate(scheduler_cfg)(
        optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=num_training_steps
    )
