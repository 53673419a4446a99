"""The flags ``effitrain estimate`` and ``effitrain plan`` share: the device planned for by default,
and ``--optimizers`` / ``--adapters`` checked against conf/ before anything is traced."""

from __future__ import annotations

from effitrain.config.errors import ConfigError


def default_device() -> str:
    """Where a run with these settings would train: CUDA when it is available."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_adapter_options(names: list[str]) -> None:
    """``--adapters``: each an option of conf/adapter (one line if not)."""
    from effitrain.config.registry import group_options

    options = group_options("adapter")
    for name in names:
        if name not in options:
            raise ConfigError(f"--adapters={name!r} is invalid: choose from {', '.join(options)}")


def check_optimizer_options(names: list[str]) -> None:
    """``--optimizers``: each an option of conf/optimizer whose package is installed (one line if not)."""
    from omegaconf import OmegaConf

    from effitrain.config.registry import CONF_DIR, group_options, install_hint, missing_module

    options = group_options("optimizer")
    for name in names:
        if name not in options:
            raise ConfigError(f"--optimizers={name!r} is invalid: choose from {', '.join(options)}")
        missing = missing_module(OmegaConf.load(CONF_DIR / "optimizer" / f"{name}.yaml"))
        if missing is not None:
            raise ConfigError(
                f"--optimizers={name!r} is invalid: {missing} is not installed ({install_hint(missing)})"
            )
