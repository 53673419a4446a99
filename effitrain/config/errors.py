"""The errors a user can cause, and how they reach the user: the bottom of effitrain's layers.

Every module may import this one; it imports no other effitrain module. A configuration a run
cannot start with is a :class:`ConfigError` whose message is one line naming the key, the bad value
and what is allowed (:func:`invalid`); a command that cannot go on says so with :func:`fail`.
"""

from __future__ import annotations

import sys


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message is one line for the user."""


class ConfigErrors(ConfigError):
    """Several problems of one config, each a one-line message; ``str()`` puts one per line."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def invalid(key: str, value, allowed: str) -> ConfigError:
    shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as typed: true, not True
    return ConfigError(f"{key}={shown} is invalid: {allowed}")


def raise_problems(problems: list[str]) -> None:
    """Nothing for no problem, a ConfigError for one, ConfigErrors for several."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigErrors(problems)


def fail(message: str, code: int = 2):
    """``message`` on stderr, each line ``effitrain: error: ...``, and exit ``code``. Bad input (2)
    is refused alike by every process a launcher started (each checks the same config): only the
    first (``RANK`` 0, or no launcher) says it, so torchrun's log holds the line once."""
    import os

    if code != 2 or os.environ.get("RANK", "0") == "0":
        for line in str(message).splitlines() or [""]:
            print(f"effitrain: error: {line}", file=sys.stderr)
    sys.exit(code)


def instantiate_node(node):
    """``hydra.utils.instantiate``, letting a ConfigError raised by the target through unwrapped."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node)
    except InstantiationException as error:
        if isinstance(error.__cause__, ConfigError):
            raise error.__cause__ from None
        raise


def chosen(cfg, group: str) -> tuple[str, str]:
    """``(key, value)`` naming ``group``'s option as a user chose it, for a message: ``("adapter",
    "lora")``; ``("optimizer._target_", <target>)`` where the command line gave the target itself, or
    the config keeps no record of the choice (composed without Hydra)."""
    from omegaconf import OmegaConf

    choice = OmegaConf.select(cfg, f"hydra.runtime.choices.{group}", default=None, throw_on_missing=False)
    given = OmegaConf.select(cfg, "hydra.overrides.task", default=None, throw_on_missing=False) or []
    if choice and not any(str(o).lstrip("+~").startswith(f"{group}._target_=") for o in given):
        return group, str(choice)
    return f"{group}._target_", str(OmegaConf.select(cfg, f"{group}._target_", default=""))
