"""The front door of a run's configuration: :func:`load` composes (``effitrain.composition``),
validates (``effitrain.validation``) and derives (``micro_batch_size`` from ``effective_batch_size``),
once, before anything heavy is loaded; :func:`task_config` is the Hydra task's door, for a config
Hydra composed.

Every error a user can cause is a :class:`ConfigError` whose message is one line naming the
key, the bad value and what is allowed.
"""

from __future__ import annotations

from omegaconf import DictConfig

from effitrain.composition import compose_checked, with_hydra_node
from effitrain.errors import ConfigError, ConfigErrors, raise_problems
from effitrain.validation import validate


def load(overrides: list[str], world_size: int = 1) -> DictConfig:
    """The front door: compose, validate (every problem of the command line at once) and derive
    (``micro_batch_size`` from ``effective_batch_size``), before anything heavy is loaded.

    Raises:
        ConfigError: one problem; ConfigErrors (a ConfigError) for several, one line each.
    """
    return checked(*compose_checked(overrides), world_size)


def checked(cfg: DictConfig, problems: list[str], world_size: int = 1) -> DictConfig:
    """:func:`load` after composition: ``problems`` (of the composition) and ``validate``'s together."""
    try:
        validate(cfg, world_size)
    except ConfigErrors as errors:
        problems = problems + errors.problems
    except ConfigError as error:
        problems = problems + [str(error)]
    raise_problems(problems)
    apply_effective_batch_size(cfg, world_size)
    return cfg


def task_config(cfg: DictConfig, hydra_node: DictConfig, world_size: int = 1) -> DictConfig:
    """The front door of the Hydra task (a job of ``train.py``): its config with its Hydra node
    attached and ``micro_batch_size`` derived, before any tracker starts. The command line was
    validated before Hydra started (``hydra_task.preflight``); the run validates again and reports."""
    cfg = with_hydra_node(cfg, hydra_node)
    apply_effective_batch_size(cfg, world_size)
    return cfg


def apply_effective_batch_size(cfg: DictConfig, world_size: int = 1) -> bool:
    """When ``effective_batch_size`` is set, derive ``micro_batch_size`` from it; True if it changed.

    A study that holds the effective batch fixed (e.g. over ``gradient_accumulation_steps``)
    sets ``effective_batch_size`` and sweeps only the accumulation. Values ``validate`` rejects
    are left as they are, for it to report.
    """
    from omegaconf import open_dict

    effective, accumulation = cfg.get("effective_batch_size"), cfg.get("gradient_accumulation_steps")
    if not isinstance(effective, int) or not isinstance(accumulation, int) or accumulation < 1:
        return False  # nothing to derive, or a value validate reports
    if effective < 1 or effective % (accumulation * world_size):
        return False
    micro = effective // (accumulation * world_size)
    if micro == cfg.micro_batch_size:
        return False
    with open_dict(cfg):
        cfg.micro_batch_size = micro
    return True
