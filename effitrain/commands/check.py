"""``effitrain check``: validate the configuration of a run, or of every job of a sweep (``-m``), and
run nothing."""

from __future__ import annotations

from effitrain.commands.train_command import MULTIRUN_FLAGS, preflight
from effitrain.config.errors import ConfigError


def check(overrides: list[str]) -> None:
    """Validate ``overrides`` as ``train`` would and say so.

    Raises:
        ConfigError: a flag other than ``-m``/``--multirun``, or the first problems of the configuration.
    """
    for flag in (a for a in overrides if a.startswith("-") and a not in MULTIRUN_FLAGS):
        # preflight leaves other flags (--cfg, --info, ...) to Hydra and checks nothing then
        raise ConfigError(f"{flag} is invalid: effitrain check takes overrides and -m/--multirun only")
    checked: list[int] = []
    preflight(overrides, jobs_checked=checked)
    if checked:  # a sweep
        print(f"effitrain: the configuration is valid: {checked[0]} jobs checked")
    else:
        print("effitrain: the configuration is valid")
