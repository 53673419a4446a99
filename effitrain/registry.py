"""The config groups, read from conf/ (the one registry of choices): which groups and options
exist, an override naming an option that does not, and which options can be built here (an
optional optimizer's package installed or not, and the extra that installs it)."""

from __future__ import annotations

from pathlib import Path

from effitrain.errors import ConfigError

# conf/ at the top of the checkout is the package effitrain.conf (pyproject.toml maps it, into the
# wheel too): Hydra reads it through this search path wherever effitrain is installed.
CONF_MODULE = "effitrain.conf"


CONF_SOURCE = f"pkg://{CONF_MODULE}"


def _conf_dir() -> Path:
    """The folder behind ``effitrain.conf``: the checkout's conf/ (editable install) or the wheel's copy."""
    from importlib.resources import files

    return Path(str(files(CONF_MODULE)))


CONF_DIR = _conf_dir()


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The options of a config group: the YAML files of its folder (the registry is conf/)."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def group_names(conf_dir: Path = CONF_DIR) -> list[str]:
    """The config groups: the folders of conf/ (``hydra`` is Hydra's own)."""
    return sorted(p.name for p in conf_dir.iterdir() if p.is_dir() and p.name != "hydra")


def check_group_overrides(overrides: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject ``group=option`` overrides naming an option that does not exist.

    Hydra would reject them too, but with a multi-line report; this gives the one-line message
    before Hydra starts. Each value of a sweep (``optimizer=adamw,adafactor``) is checked.

    Raises:
        ConfigError: an option is not a file of its group, or an override breaks Hydra's grammar.
    """
    from effitrain.overrides import parse, values

    groups = set(group_names(conf_dir))
    for override in parse(overrides):
        if override.key_or_group not in groups:
            continue
        options = group_options(override.key_or_group, conf_dir)
        for choice in values(override) or []:
            if choice not in options and choice != "null":
                raise ConfigError(
                    f"{override.key_or_group}={choice!r} is not an option: choose one of {', '.join(options)}"
                )


def missing_module(optimizer_cfg) -> str | None:
    """The top-level module an optimizer node's ``_target_`` needs that is not installed, or None."""
    import importlib.util

    module = str(optimizer_cfg.get("_target_", "")).split(".")[0]
    return module if module and importlib.util.find_spec(module) is None else None


def installed_optimizers(names: list[str]) -> list[str]:
    """``names`` (options of conf/optimizer) less those whose package is missing, each said on
    stderr in one line: ``estimate`` and ``plan`` cover every option that can be built here."""
    import sys

    from omegaconf import OmegaConf

    kept = []
    for name in names:
        node = OmegaConf.load(CONF_DIR / "optimizer" / f"{name}.yaml")
        missing = missing_module(node)
        if missing is None:
            kept.append(name)
            continue
        print(f"effitrain: optimizer={name} left out: {missing} is not installed ({install_hint(missing)})",
              file=sys.stderr)  # fmt: skip
    return kept


def install_hint(module: str) -> str:
    extra = optional_extra(module.split(".")[0])
    return f"pip install 'effitrain[{extra}]'" if extra else f"install the package that provides {module}"


def optional_extra(module: str) -> str | None:
    """The extra of effitrain's metadata (``pip install 'effitrain[X]'``) that installs ``module``."""
    import re
    from importlib.metadata import PackageNotFoundError, requires

    try:
        requirements = requires("effitrain") or []
    except PackageNotFoundError:
        return None
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", marker)
        distribution = re.split(r"[\s<>=!~\[(]", name.strip(), maxsplit=1)[0]
        if extra and distribution.replace("-", "_").lower() == module.lower():
            return extra.group(1)
    return None
