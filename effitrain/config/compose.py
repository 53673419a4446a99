"""Composition: the one way a run config is made from command-line overrides, typed by
effitrain's schema, with its Hydra node (``cfg.hydra``), as ``train.py`` would compose it.

:func:`compose` is the one public way: Hydra's compose, with an unknown key named with the nearest
real ones and every problem in one line. :func:`compose_checked` is its form for the front door
(:func:`effitrain.config.load.load`): values of the wrong type are found before composing and left
out, and returned as problems, so that they are reported with validation's, all at once.
"""

from __future__ import annotations

from omegaconf import DictConfig

from effitrain.config.errors import ConfigError, invalid, raise_problems
from effitrain.config.registry import (
    CONF_MODULE,
    check_group_overrides,
    group_names,
    group_options,
    is_target_node,
)
from effitrain.util.compat import config_node

# Mappings whose keys are passed on as keyword arguments, so ``+node.key=...`` adds something a
# target reads: datasets.load_dataset's, the model config's (checked by validate), the
# architecture's. A ``_target_`` node is open too, wherever it is: ``check_targets`` binds its keys
# to the target's arguments.
OPEN_NODES = ("data.load_args", "model.config_overrides", "model.architecture")


def plain_open_overrides(overrides: list[str]) -> list[str]:
    """``model.config_overrides.key=value`` as ``++model.config_overrides.key=value``: the node is open
    (its keys are the model config's, checked by ``validate``), so the plain form sets a key whether or
    not the model's file has it."""
    from effitrain.config.overrides import parse

    result = []
    for text in overrides:
        plain = not str(text).startswith(("+", "~")) and str(text).startswith("model.config_overrides.")
        result.append(f"++{text}" if plain and parse([text]) else text)
    return result


def _compose(overrides: list[str]) -> DictConfig:
    """Hydra's compose API with one-line errors: an option that does not exist, a key Hydra does not
    know (its own words), or a value the schema's type rejects (:class:`WrongType`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import ConfigCompositionException

    check_group_overrides(overrides)
    overrides = plain_open_overrides(overrides)
    try:
        with initialize_config_module(CONF_MODULE, version_base="1.3", job_name="effitrain"):
            cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
            # resolvers such as ${hydra:runtime.cwd} read the singleton while the config is in use
            HydraConfig.instance().set_config(cfg)
    except ConfigCompositionException as error:
        from omegaconf.errors import ValidationError

        from effitrain.config.schema import field_type

        cause = error.__cause__
        if isinstance(cause, ValidationError) and cause.full_key:  # a value the schema's type rejects
            allowed_values = _allowed(cause.full_key, field_type(cause.object_type, cause.key))
            raise WrongType(invalid(cause.full_key, cause.value, allowed_values).args[0]) from None
        raise ConfigError(" ".join(str(error).split())[:500]) from None
    return cfg


class WrongType(ConfigError):
    """A value the schema's type rejects, set by a file (an override's is :func:`wrong_types`'s)."""


def compose_checked(overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """The composed config, and the problems of the overrides it had to leave out to compose it.

    Keys the config does not have are refused (with the nearest real keys: ``lr`` ->
    ``optimizer.lr``), and so is a ``+key`` that nothing reads. A value of the wrong type for the
    schema is a problem whose override is left out (:func:`wrong_types`, every one found before
    Hydra composes), so the rest is composed once and can still be validated: every problem of a
    command line is reported at once.

    Raises:
        ConfigError: an unknown key or option, a grammar error, or a file's value of the wrong type:
            nothing to validate.
    """
    from effitrain.config.overrides import parse

    parsed = parse(overrides)
    groups = set(group_names())
    problems = wrong_types([o for o in parsed if not _is_choice(o, groups)])
    wrong = {line for line, _ in problems}
    try:
        cfg = _compose([o.input_line for o in parsed if o.input_line not in wrong])
    except WrongType:  # a file's value: no override to leave out
        raise
    except ConfigError:  # an unknown key, most likely: name it with the nearest real ones
        _check_keys_exist(_compose([o.input_line for o in parsed if _is_choice(o, groups)]), parsed, groups)
        raise
    # composed, so every key exists; a +key outside the nodes whose keys a target reads is refused
    _check_keys_exist(cfg, [o for o in parsed if o.is_add() or o.is_force_add()], groups, added=True)
    _check_deletions(cfg, [o for o in parsed if o.is_delete()])
    return cfg, [problem for _, problem in problems]


def _check_deletions(cfg: DictConfig, deletions) -> None:
    """``~key`` deletes only what has a default elsewhere: a target's argument (its own default then
    applies) or a key of an open node; a key or group every run reads is refused.

    Raises:
        ConfigError: one line naming the deleted key and what ``~`` may delete.
    """
    for override in deletions:
        key = override.key_or_group
        if "." in key and not _is_hydra(key) and _in_open_node(cfg, key):
            continue
        raise ConfigError(
            f"~{key} is invalid: every run reads {key}: give it a value instead (~ deletes only an argument "
            f"of a _target_ node, or a key under {', '.join(OPEN_NODES)})"
        )


def wrong_types(parsed) -> list[tuple[str, str]]:
    """(override, one-line problem) for each override of a key (not a group's choice) whose value
    the schema's type for its key rejects (``seed=x``), as OmegaConf would while composing: each
    value is set on an empty :class:`~effitrain.config.schema.RunConfig`, so every such override is
    found in one pass and Hydra composes the rest once."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from effitrain.config.schema import RunConfig, field_type

    typed = OmegaConf.structured(RunConfig)
    found = []
    for override in parsed:
        key = override.key_or_group
        if override.is_delete() or override.is_sweep_override() or not _has_key(typed, key):
            continue
        try:
            OmegaConf.update(typed, key, override.value(), merge=False)
        except ValidationError:
            parent = OmegaConf.select(typed, key.rpartition(".")[0]) if "." in key else typed
            kind = field_type(OmegaConf.get_type(parent), key.rpartition(".")[2])
            found.append((override.input_line, invalid(key, override.value(), _allowed(key, kind)).args[0]))
    return found


def _allowed(key: str, kind) -> str:
    """What ``key`` accepts: a memory technique's own words where it has them (a Union's type
    names nothing a user types), else its type's (:func:`effitrain.config.schema.allowed`)."""
    from effitrain.config.schema import allowed
    from effitrain.config.techniques import TECHNIQUES

    own = next((getattr(t, "allowed", None) for t in TECHNIQUES if t.key == key), None)
    return own or allowed(kind)


def _is_choice(override, groups: set[str]) -> bool:
    return override.key_or_group in groups or _is_hydra(override.key_or_group)


def compose(overrides: list[str]) -> DictConfig:
    """The run config ``train.py`` would compose for these overrides, typed by effitrain's schema,
    with its Hydra node (``cfg.hydra``), as Hydra's compose API gives it (not validated: that is
    :func:`effitrain.config.load.load`).

    Raises:
        ConfigError: an option or key that does not exist (named with the nearest real ones), a
            ``+key`` nothing reads, a value of the wrong type; ConfigErrors for several.
    """
    cfg, problems = compose_checked(overrides)
    raise_problems(problems)
    return cfg


def _check_keys_exist(cfg: DictConfig, parsed, groups: set[str], added: bool = False) -> None:
    """ConfigError for the first override naming a key ``cfg`` lacks, with the nearest real keys;
    ``added``: ``cfg`` already holds the overrides' own ``+key`` additions."""
    import difflib

    from effitrain.config.overrides import typed_value

    adding = {o.key_or_group for o in parsed if added and (o.is_add() or o.is_force_add())}
    known = [k for k in _leaf_keys(cfg) if not k.startswith("hydra.") and k not in adding]
    for override in parsed:
        key = override.key_or_group
        if key in groups or _is_hydra(key) or override.is_delete():
            continue
        adds = override.is_add() or override.is_force_add()
        exists = _has_key(cfg, key) and not (added and adds)
        if exists or (adds and _in_open_node(cfg, key)):
            continue
        same_name = [k for k in known if k.rpartition(".")[2] == key.rpartition(".")[2] and k != key]
        near = list(dict.fromkeys(same_name + difflib.get_close_matches(key, known, n=3, cutoff=0.6)))[:3]
        group = difflib.get_close_matches(key, sorted(groups), n=1, cutoff=0.75) if "." not in key else []
        if group:  # optimizr=adamw: the config group, with its options
            value = typed_value(override)
            near = [f"{group[0]}={value}" if value in group_options(group[0]) else f"{group[0]} (a config group: "
                    f"{', '.join(group_options(group[0]))})"]  # fmt: skip
        hint = (
            f"did you mean {' or '.join(near)}?" if near else "see `python train.py --cfg job` for the keys"
        )
        what = "adds a key nothing reads" if adds else "is not a config key"
        raise ConfigError(f"{key}={typed_value(override)!r} {what}: {hint}")


def _in_open_node(cfg: DictConfig, key: str) -> bool:
    """``key`` (dotted) is set in an open mapping, or anywhere under a ``_target_`` node."""
    from omegaconf import OmegaConf

    parents = key.split(".")[:-1]
    if ".".join(parents) in OPEN_NODES:
        return True
    return any(
        is_target_node(OmegaConf.select(cfg, ".".join(parents[:n]))) for n in range(1, len(parents) + 1)
    )


def _leaf_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for key in node:
        path = f"{prefix}{key}"
        value = config_node(node, key)
        keys += _leaf_keys(value, f"{path}.") if isinstance(value, DictConfig) else [path]
    return keys


def _is_hydra(key: str) -> bool:
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _has_key(cfg: DictConfig, key: str) -> bool:
    """``key`` (dotted) is in ``cfg``, also when its value is still missing (``???``)."""
    from omegaconf import OmegaConf

    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    return OmegaConf.is_dict(parent) and leaf in parent.keys()


def command_line_overrides(cfg: DictConfig) -> list:
    """The job's own overrides (Hydra's record in ``cfg.hydra``), parsed; [] for a config built by hand."""
    from omegaconf import OmegaConf

    from effitrain.config.overrides import parse

    hydra = cfg.get("hydra")
    if hydra is None:
        return []
    return parse(OmegaConf.to_container(hydra.overrides.task, resolve=False))


def with_hydra_node(cfg: DictConfig, hydra_node: DictConfig) -> DictConfig:
    """``cfg`` carrying its job's Hydra node (choices, overrides, folders), as ``compose(...,
    return_hydra_config=True)`` gives it: the Hydra task calls this once, so a run reads what Hydra
    decided from its own config and never from the HydraConfig singleton."""
    from omegaconf import open_dict

    if "hydra" not in cfg:
        with open_dict(cfg):
            cfg.hydra = hydra_node
    return cfg
