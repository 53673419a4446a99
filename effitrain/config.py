"""Configuration checks, in one place, before anything heavy is loaded.

Every error a user can cause is a :class:`ConfigError` whose message is one line naming the
key, the bad value and what is allowed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
LR_SCHEDULERS = ("linear", "cosine", "constant")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
INIT_MODES = ("pretrained", "random")


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message is one line for the user."""


def invalid(key: str, value, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is invalid: {allowed}")


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The options of a config group: the YAML files of its folder (the registry is conf/)."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def check_group_overrides(overrides: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject ``group=option`` overrides naming an option that does not exist.

    Hydra would reject them too, but with a multi-line report; this gives the one-line message
    before Hydra starts. Sweep values (``optimizer=adamw,adafactor``) are checked one by one.

    Raises:
        ConfigError: an option is not a file of its group.
    """
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or key.startswith(("+", "~", "hydra")) or not (conf_dir / key).is_dir():
            continue
        if value in ("null", "") or value.startswith(("choice(", "range(", "glob(")):
            continue
        options = group_options(key, conf_dir)
        for choice in value.split(","):
            if choice not in options:
                raise ConfigError(f"{key}={choice!r} is not an option: choose one of {', '.join(options)}")


def check_output_overrides(overrides: list[str]) -> None:
    """Reject a ``hydra.run.dir`` / ``hydra.sweep.dir`` override that could not be written, before
    Hydra creates it and fails with a traceback.

    Raises:
        ConfigError: the folder (or its nearest existing parent) is not a writable folder.
    """
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or key not in ("hydra.run.dir", "hydra.sweep.dir") or "${" in value:
            continue
        path = Path(value).expanduser().absolute()
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            raise invalid(key, value, f"{existing} is a file, not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise invalid(key, value, f"{existing} cannot be written")


def _at_least(cfg: DictConfig, key: str, minimum: int, allow_null: bool = False) -> None:
    value = cfg.get(key)
    if value is None and allow_null:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        suffix = " (or null)" if allow_null else ""
        raise invalid(key, value, f"must be an integer >= {minimum}{suffix}")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def validate(cfg: DictConfig, world_size: int = 1) -> None:
    """Check a composed run config before any data or model is loaded.

    ``world_size`` is the number of data-parallel processes (the effective batch spans them all).

    Raises:
        ConfigError: the first problem found, named by its key.
    """
    import torch

    _at_least(cfg, "gradient_accumulation_steps", 1)
    for key in ("micro_batch_size", "epochs", "eval_batch_size"):
        _at_least(cfg, key, 1)
    _at_least(cfg, "max_steps", 1, allow_null=True)
    _at_least(cfg, "effective_batch_size", 1, allow_null=True)
    effective = cfg.get("effective_batch_size")
    if effective is not None and effective % (cfg.gradient_accumulation_steps * world_size):
        per_step = cfg.gradient_accumulation_steps * world_size
        raise invalid(
            "effective_batch_size",
            effective,
            f"must be a multiple of gradient_accumulation_steps x processes = {per_step}, "
            "so that every micro-batch holds effective_batch_size / that many samples",
        )
    _at_least(cfg, "checkpoint_every", 1, allow_null=True)
    _at_least(cfg, "checkpoint_keep", 1)
    resume = cfg.get("resume")
    if resume is not None and resume != "auto" and not os.path.exists(os.path.expanduser(str(resume))):
        raise invalid("resume", resume, "no such checkpoint folder: give null, auto or an existing path")
    _at_least(cfg, "max_length", 2)
    lr = cfg.optimizer.get("lr")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0:
        raise invalid("optimizer.lr", lr, "must be a number > 0")
    if not isinstance(cfg.warmup_ratio, (int, float)) or not 0 <= cfg.warmup_ratio < 1:
        raise invalid("warmup_ratio", cfg.warmup_ratio, "must be in [0, 1)")
    if not isinstance(cfg.max_grad_norm, (int, float)) or cfg.max_grad_norm < 0:
        raise invalid("max_grad_norm", cfg.max_grad_norm, "must be >= 0 (0 disables clipping)")
    if not isinstance(cfg.weight_decay, (int, float)) or cfg.weight_decay < 0:
        raise invalid("weight_decay", cfg.weight_decay, "must be >= 0")
    if cfg.lr_scheduler not in LR_SCHEDULERS:
        raise invalid("lr_scheduler", cfg.lr_scheduler, f"choose one of {', '.join(LR_SCHEDULERS)}")

    precision = cfg.precision.mixed_precision
    if precision == "fp16" and not cuda_available():
        raise invalid(
            "precision", "fp16", "fp16 needs a CUDA device (none found): use precision=bf16 or fp32"
        )
    if precision == "bf16" and cuda_available() and not torch.cuda.is_bf16_supported():
        raise invalid("precision", "bf16", "this GPU lacks bf16: use precision=fp16 or fp32")
    target = str(cfg.optimizer.get("_target_", ""))
    if "Paged" in target and not cuda_available():
        raise invalid(
            "optimizer", target, "paged optimizers need a CUDA device: use adamw, adafactor or adam8bit"
        )
    if cfg.compile.mode not in COMPILE_MODES:
        raise invalid("compile.mode", cfg.compile.mode, f"choose one of {', '.join(COMPILE_MODES)}")

    if not isinstance(cfg.model.get("trust_remote_code"), bool):
        raise invalid("model.trust_remote_code", cfg.model.get("trust_remote_code"), "must be true or false")
    if cfg.model.init not in INIT_MODES:
        raise invalid("model.init", cfg.model.init, f"choose one of {', '.join(INIT_MODES)}")
    for key in ("name_or_path", "tokenizer"):
        value = cfg.model.get(key)
        if value and _looks_like_path(value) and not os.path.exists(os.path.expanduser(value)):
            raise invalid(f"model.{key}", value, "no such folder (give an existing path or a hub id)")


def apply_effective_batch_size(cfg: DictConfig, world_size: int = 1) -> bool:
    """When ``effective_batch_size`` is set, derive ``micro_batch_size`` from it; True if it changed.

    A study that holds the effective batch fixed (e.g. over ``gradient_accumulation_steps``)
    sets ``effective_batch_size`` and sweeps only the accumulation; ``validate`` has checked
    that it divides.
    """
    from omegaconf import open_dict

    effective = cfg.get("effective_batch_size")
    if effective is None:
        return False
    micro = effective // (cfg.gradient_accumulation_steps * world_size)
    if micro == cfg.micro_batch_size:
        return False
    with open_dict(cfg):
        cfg.micro_batch_size = micro
    return True


def _looks_like_path(value: str) -> bool:
    """A local path rather than a hub id (``org/name``): absolute, relative to ., or home."""
    return value.startswith(("/", "./", "../", "~")) or value.count("/") > 1


def check_output_dir(path: Path) -> None:
    """Raises ConfigError when results could not be written to ``path``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        # a name of its own: ranks of one job probe the same folder at the same moment
        with tempfile.NamedTemporaryFile(dir=path, prefix=".effitrain-write-probe-"):
            pass
    except OSError as error:
        raise invalid(
            "hydra.run.dir", str(path), f"the output folder cannot be written ({error.strerror})"
        ) from None
