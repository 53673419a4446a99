"""The front door of a run's configuration: :func:`load` composes (``effitrain.config.compose``),
validates (``effitrain.config.validate``) and derives (``micro_batch_size`` from ``effective_batch_size``),
once, before anything heavy is loaded. The Hydra task's config, which Hydra composed, is derived
by its run (first) and validated by the run's ``prepare`` (:mod:`effitrain.run.recipe`).

``train.py`` validates the command line before Hydra starts (``effitrain.commands.train_command.preflight``)
and hands the :func:`identity` of what it validated to the Hydra task: the run Hydra then starts
with that very config does not validate it again.

Every error a user can cause is a :class:`ConfigError` whose message is one line naming the
key, the bad value and what is allowed.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from effitrain.config.compose import compose_checked
from effitrain.config.errors import ConfigError, ConfigErrors, raise_problems
from effitrain.config.validate import validate


def load(overrides: list[str], world_size: int = 1, **validation) -> DictConfig:
    """The front door: compose, validate (every problem of the command line at once; ``validation``:
    ``validate``'s ``device`` and ``loads``) and derive (``micro_batch_size`` from
    ``effective_batch_size``), before anything heavy is loaded.

    Raises:
        ConfigError: one problem; ConfigErrors (a ConfigError) for several, one line each.
    """
    return checked(*compose_checked(overrides), world_size, **validation)


def checked(cfg: DictConfig, problems: list[str], world_size: int = 1, **validation) -> DictConfig:
    """:func:`load` after composition: ``problems`` (of the composition) and ``validate``'s together."""
    try:
        validate(cfg, world_size, **validation)
    except ConfigErrors as errors:
        problems = problems + errors.problems
    except ConfigError as error:
        problems = problems + [str(error)]
    raise_problems(problems)
    apply_effective_batch_size(cfg, world_size)
    return cfg


def derive(cfg: DictConfig, world_size: int = 1) -> None:
    """What a run derives from its config before it starts (:mod:`effitrain.run.recipe`, and the folder
    policy comparing a rerun): ``micro_batch_size`` from ``effective_batch_size``, an adapter's lr made
    the optimizer's (:func:`apply_adapter_lr`)."""
    apply_effective_batch_size(cfg, world_size)
    apply_adapter_lr(cfg)


def identity(cfg: DictConfig, world_size: int = 1) -> str:
    """What validation reads of a config, as one string: its keys, unresolved and derived, with what
    validation reads of its Hydra node (the command line's overrides, the groups' choices) and the
    number of processes (``repr``: any key type). ``train.py``'s front door hands the identity of the
    config it validated to the Hydra task, whose run skips validating that very config again."""
    import copy

    derived = copy.deepcopy(cfg)
    apply_effective_batch_size(derived, world_size)
    plain = OmegaConf.to_container(derived, resolve=False)
    hydra = plain.pop("hydra", None) or {}
    # the front door hands Hydra the run folder it locked: a key validation does not read
    task = [o for o in hydra.get("overrides", {}).get("task") or [] if not o.startswith("hydra.run.dir=")]
    read = [task, hydra.get("runtime", {}).get("choices")]
    return repr([plain, read, world_size])


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


def apply_adapter_lr(cfg: DictConfig) -> bool:
    """An adapter's ``lr`` made the optimizer's (``optimizer.lr``), unless the command line sets
    ``optimizer.lr`` itself; True if it changed. LoRA's updates start at zero and are scaled by
    ``lora_alpha / r``: they need a higher learning rate than full fine-tuning's to move in as many
    steps, so the adapter group carries its own and the run's summary (``cfg/lr``) shows the one used."""
    import math

    from omegaconf import open_dict

    from effitrain.config.compose import command_line_overrides

    adapter = cfg.get("adapter")
    lr = adapter.get("lr") if adapter is not None and adapter.get("_target_") else None
    # a value the validation refuses is left for it to name as adapter.lr, not copied to optimizer.lr
    usable = isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0
    if not usable or cfg.optimizer.get("lr") == lr:
        return False
    if any(o.key_or_group == "optimizer.lr" for o in command_line_overrides(cfg)):
        return False
    with open_dict(cfg):
        cfg.optimizer.lr = lr
    return True
