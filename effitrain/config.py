"""Configuration checks, in one place, before anything heavy is loaded.

Every error a user can cause is a :class:`ConfigError` whose message is one line naming the
key, the bad value and what is allowed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from omegaconf import DictConfig

from effitrain.atomic import probe_write
from effitrain.errors import ConfigError, invalid

# conf/ at the top of the checkout is the package effitrain.conf (pyproject.toml maps it, into the
# wheel too): Hydra reads it through this search path wherever effitrain is installed.
CONF_MODULE = "effitrain.conf"
CONF_SOURCE = f"pkg://{CONF_MODULE}"


def _conf_dir() -> Path:
    """The folder behind ``effitrain.conf``: the checkout's conf/ (editable install) or the wheel's copy."""
    from importlib.resources import files

    return Path(str(files(CONF_MODULE)))


CONF_DIR = _conf_dir()
# Nodes whose keys are passed on as keyword arguments, so ``+node.key=...`` adds something a target
# reads (the optimizer's and logger's arguments are checked against their signatures).
OPEN_NODES = ("data.load_args", "model.config_overrides", "model.architecture", "optimizer", "logger")


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


def check_output_overrides(overrides: list[str]) -> None:
    """Reject a ``hydra.run.dir`` / ``hydra.sweep.dir`` that could not be written, before Hydra
    creates it and fails with a traceback.

    Raises:
        ConfigError: the folder (or its nearest existing parent) is not a writable folder.
    """
    from effitrain.overrides import parse, values

    for override in parse(overrides):
        key = override.key_or_group
        if key not in ("hydra.run.dir", "hydra.sweep.dir") or override.is_sweep_override():
            continue
        check_output_folder(key, values(override)[0])


def check_output_folder(key: str, value: str) -> None:
    """ConfigError when the folder ``value`` (or its nearest existing parent) could not be written."""
    if "${" in value:
        return
    path = Path(value).expanduser().absolute()

    def exists(candidate: Path) -> bool:
        try:
            return candidate.exists()
        except OSError:  # a name too long for the file system: not there
            return False

    existing = next(p for p in (path, *path.parents) if exists(p))
    try:
        longest = os.pathconf(existing if existing.is_dir() else existing.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    for part in path.relative_to(existing).parts:
        if "\0" in part or len(part.encode()) > longest:
            raise invalid(key, value, f"the folder name {part[:40]!r}... is not one this file system takes "
                                      f"(at most {longest} bytes, no NUL): give a shorter name")  # fmt: skip
    if not existing.is_dir():
        raise invalid(key, value, f"{existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise invalid(key, value, f"{existing} cannot be written")
    try:
        probe_write(existing)  # a full disk: refused here, before Hydra writes its record
    except OSError as error:
        raise invalid(key, value, f"{existing} cannot be written ({error.strerror})") from None


def _at_least(cfg: DictConfig, key: str, minimum: int, allow_null: bool = False) -> None:
    value = cfg.get(key)
    if value is None and allow_null:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        suffix = " (or null)" if allow_null else ""
        raise invalid(key, value, f"must be an integer >= {minimum}{suffix}")


def _boolean(cfg: DictConfig, key: str) -> None:
    if not isinstance(cfg.get(key, False), bool):
        raise invalid(key, cfg.get(key), "must be true or false")


def _finite(key: str, value, condition: str, ok) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise invalid(key, value, condition)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class ConfigErrors(ConfigError):
    """Several problems of one config, each a one-line message; ``str()`` puts one per line."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def _collect(checks) -> list[str]:
    problems = []
    for check in checks:
        try:
            check()
        except ConfigErrors as errors:
            problems += errors.problems
        except ConfigError as error:
            problems.append(str(error))
    return problems


def validate(cfg: DictConfig, world_size: int = 1) -> None:
    """Check a composed run config before any data or model is loaded.

    Every check runs, so a user sees all problems at once. ``world_size`` is the number of
    data-parallel processes (the effective batch spans them all).

    Raises:
        ConfigError: one problem; ConfigErrors (a ConfigError) for several, one line each.
    """
    _assets(cfg)  # every check below reads these values
    problems = _collect(
        [
            lambda: _missing_values(cfg),
            lambda: _seed(cfg),
            lambda: _synthetic(cfg),
            lambda: _at_least(cfg, "gradient_accumulation_steps", 1),
            lambda: _at_least(cfg, "micro_batch_size", 1),
            lambda: _at_least(cfg, "epochs", 1),
            lambda: _at_least(cfg, "eval_batch_size", 1),
            lambda: _at_least(cfg, "max_steps", 1, allow_null=True),
            lambda: _at_least(cfg, "eval_every", 1, allow_null=True),
            lambda: _at_least(cfg, "effective_batch_size", 1, allow_null=True),
            lambda: _effective_batch(cfg, world_size),
            lambda: _at_least(cfg, "checkpoint_every", 1, allow_null=True),
            lambda: _at_least(cfg, "checkpoint_keep", 1),
            lambda: _resume(cfg),
            lambda: _at_least(cfg, "max_length", 2),
            lambda: _boolean(cfg, "gradient_checkpointing"),
            lambda: _finite(
                "optimizer.lr", cfg.optimizer.get("lr"), "must be a finite number > 0", lambda v: v > 0
            ),
            lambda: _finite("warmup_ratio", cfg.warmup_ratio, "must be in [0, 1)", lambda v: 0 <= v < 1),
            lambda: _finite(
                "max_grad_norm", cfg.max_grad_norm, "must be >= 0 (0 disables clipping)", lambda v: v >= 0
            ),
            lambda: _finite("weight_decay", cfg.weight_decay, "must be >= 0", lambda v: v >= 0),
            lambda: _precision(cfg),
            lambda: _compile(cfg),
            lambda: _model(cfg),
            lambda: _named_is_built(cfg),
        ]
    )
    if not problems:  # these build things from the values above, which must be sane first
        problems = _collect(
            [
                lambda: _optimizer(cfg),
                lambda: _config_overrides(cfg),
                lambda: _task_model(cfg),
                lambda: _max_length(cfg),
                lambda: _data_files(cfg),
            ]
        )
    if not problems:  # after the model's type is known to fit the task: the most specific message first
        problems = _collect([lambda: _weights(cfg)])
    _raise(problems)


def _assets(cfg: DictConfig) -> None:
    """The ``data`` and ``model`` nodes resolve: a file of a package that is not installed
    (``${effitrain.asset:...}``) is one line naming the key, not a traceback from deep inside a run."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    for group in ("data", "model"):
        try:
            OmegaConf.to_container(cfg[group], resolve=True)
        except InterpolationResolutionError as error:
            raw = OmegaConf.to_container(cfg, resolve=False)
            for part in str(error.full_key).split("."):
                raw = raw.get(part) if isinstance(raw, dict) else None
            reason = str(error).splitlines()[0].split("interpolation: ", 1)[-1]
            raise invalid(error.full_key, raw, reason) from None


MAX_SEED = 2**32 - 1  # numpy's generators take no larger seed (transformers.set_seed seeds numpy too)


def _seed(cfg: DictConfig) -> None:
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise invalid("seed", seed, f"must be an integer in 0..{MAX_SEED}")


SYNTHETIC_MAX_LABELS = 6  # the keyword classes effitrain.data.load_synthetic makes (a test holds them equal)


def _synthetic(cfg: DictConfig) -> None:
    """The generated data's sizes (``data=synthetic``), before the loader would fail on them."""
    data = cfg.get("data")
    if data is None or not str(data.get("_target_", "")).endswith("load_synthetic"):
        return
    problems = _collect(
        [
            lambda: _at_least(data, "num_train", 1),
            lambda: _at_least(data, "num_eval", 1),
            lambda: _at_least(data, "words_per_text", 1),
            lambda: _at_least(data, "min_words_per_text", 1, allow_null=True),
        ]
    )
    labels = data.get("num_labels")
    if isinstance(labels, bool) or not isinstance(labels, int) or not 2 <= labels <= SYNTHETIC_MAX_LABELS:
        problems.append(
            invalid("num_labels", labels, f"must be an integer between 2 and {SYNTHETIC_MAX_LABELS}").args[0]
        )
    minimum, words = data.get("min_words_per_text"), data.get("words_per_text")
    if not problems and minimum is not None and minimum > words:
        problems.append(
            invalid("min_words_per_text", minimum, f"must be at most words_per_text = {words}").args[0]
        )
    _raise([f"data.{p}" for p in problems])


def _missing_values(cfg: DictConfig) -> None:
    from omegaconf import OmegaConf

    missing = []
    for key in cfg:
        if key == "hydra":
            continue
        node = cfg._get_node(key)
        if OmegaConf.is_config(node):
            missing += sorted(OmegaConf.missing_keys(node))
        elif OmegaConf.is_missing(cfg, key):
            missing.append(str(key))
    if missing:
        raise ConfigErrors([invalid(key, "???", "a value is required: give it on the command line").args[0]
                            for key in sorted(missing)])  # fmt: skip


def _effective_batch(cfg: DictConfig, world_size: int) -> None:
    effective = cfg.get("effective_batch_size")
    accumulation = cfg.get("gradient_accumulation_steps")
    if not isinstance(effective, int) or not isinstance(accumulation, int) or accumulation < 1:
        return
    per_step = accumulation * world_size
    if effective % per_step:
        raise invalid(
            "effective_batch_size",
            effective,
            f"must be a multiple of gradient_accumulation_steps x processes = {per_step}, "
            "so that every micro-batch holds effective_batch_size / that many samples",
        )
    given = [
        o for o in command_line_overrides(cfg) if o.key_or_group == "micro_batch_size" and not o.is_delete()
    ]
    if given and not given[-1].is_sweep_override():
        micro = given[-1].value()
        if micro != effective // per_step:
            raise invalid(
                "micro_batch_size", micro,
                f"effective_batch_size={effective} with gradient_accumulation_steps x processes = {per_step} "
                f"sets it to {effective // per_step}: give one of the two",
            )  # fmt: skip


def _resume(cfg: DictConfig) -> None:
    resume = cfg.get("resume")
    if resume is not None and resume != "auto" and not os.path.exists(os.path.expanduser(str(resume))):
        raise invalid("resume", resume, "no such checkpoint folder: give null, auto or an existing path")


def _precision(cfg: DictConfig) -> None:
    import torch

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


def _compile(cfg: DictConfig) -> None:
    # compile.mode is an enum of the schema: composition has checked it
    if cfg.compile.enabled:
        import torch

        if cfg.compile.backend not in torch.compiler.list_backends(exclude_tags=()):
            usual = torch.compiler.list_backends()  # without the debugging and experimental ones
            raise invalid("compile.backend", cfg.compile.backend, f"choose one of {', '.join(usual)}")


def _model(cfg: DictConfig) -> None:
    # model.init and trust_remote_code are typed by the schema: composition has checked them
    for key in ("name_or_path", "tokenizer"):
        value = cfg.model.get(key)
        if value and _looks_like_path(value) and not os.path.exists(os.path.expanduser(value)):
            raise invalid(f"model.{key}", value, "no such folder (give an existing path or a hub id)")


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


def _weights(cfg: DictConfig) -> None:
    if cfg.model.get("init") == "pretrained" and not has_weights(str(cfg.model.get("name_or_path"))):
        raise invalid(
            "model.init", "pretrained",
            f"model.name_or_path={cfg.model.get('name_or_path')!r} has no weights here (no *.safetensors or "
            "*.bin in the folder, or the hub id is neither reachable nor cached): give model.init=random",
        )  # fmt: skip


def has_weights(name_or_path: str) -> bool:
    """Pretrained weights can be loaded: a local folder holding weight files, or a hub id that is
    cached or reachable (a local path that does not exist is ``_model``'s to name)."""
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        names = os.listdir(path)
        return any(n.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json")) for n in names)
    if _looks_like_path(name_or_path):
        return True
    from effitrain.assets import hub_unreachable

    if not hub_unreachable():
        return True  # the hub answers: its own error names a missing repository
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name_or_path, "config.json"), str)
    except Exception:  # noqa: BLE001 - not a valid repository id
        return False


def command_line_overrides(cfg: DictConfig) -> list:
    """The job's own overrides (Hydra's record in ``cfg.hydra``), parsed; [] for a config built by hand."""
    from omegaconf import OmegaConf

    from effitrain.overrides import parse

    hydra = cfg.get("hydra")
    if hydra is None:
        return []
    return parse(OmegaConf.to_container(hydra.overrides.task, resolve=False))


def _named_is_built(cfg: DictConfig) -> None:
    """What ``model.name_or_path`` names is what is built: a model described by ``model.architecture``
    (``init=random``) is refused under another model's name, and ``model.architecture.*`` given with
    a folder whose own config.json decides the architecture is refused rather than ignored."""
    model = cfg.model
    given = [o for o in command_line_overrides(cfg) if o.key_or_group.startswith("model.architecture.")]
    if local_config_file(model.get("name_or_path")) and uses_named_config(model) and given:
        key = given[0].key_or_group
        raise invalid(key, given[0].value(),
                      f"model.name_or_path={model.name_or_path!r} holds a config.json, which decides the "
                      f"architecture: give model.config_overrides.{key.rpartition('.')[2]} instead")  # fmt: skip
    name = str(model.get("name_or_path"))
    if uses_named_config(model) or (_looks_like_path(name) and not os.path.exists(os.path.expanduser(name))):
        return  # a path that does not exist: _model names it
    hydra = cfg.get("hydra")
    choice = hydra.runtime.choices.get("model") if hydra is not None else None
    path = CONF_DIR / "model" / f"{choice}.yaml"
    if not choice or not path.is_file():
        return
    from omegaconf import OmegaConf

    own = OmegaConf.load(path).get("name_or_path")
    if isinstance(own, str) and "${" not in own and own != model.name_or_path:
        raise invalid(
            "model.name_or_path", model.name_or_path,
            f"with model.init=random, model={choice} builds its own model.architecture ({own}), not this "
            "model: give a local folder holding a config.json, model.init=pretrained, or model.architecture={}",
        )  # fmt: skip


# Keys effitrain sets itself in the model's config: a value in model.config_overrides would be replaced.
SET_BY_EFFITRAIN = {
    "num_labels": "the data's label column decides the number of classes",
    "id2label": "the data's label column decides the classes",
    "label2id": "the data's label column decides the classes",
}


def _config_overrides(cfg: DictConfig) -> None:
    """Every ``model.config_overrides`` key is a setting of the model's config class, not one that
    effitrain sets itself, and not one that ``model.architecture`` sets too."""
    import difflib
    import inspect

    from omegaconf import OmegaConf

    overrides = OmegaConf.to_container(cfg.model.config_overrides, resolve=True)
    if not overrides:
        return
    from_architecture = not uses_named_config(cfg.model)
    architecture = OmegaConf.to_container(cfg.model.architecture, resolve=True) if from_architecture else {}
    causal = not task_class(cfg).uses_labels
    for key, value in overrides.items():
        name = f"model.config_overrides.{key}"
        if key in SET_BY_EFFITRAIN:
            raise invalid(name, value, f"{SET_BY_EFFITRAIN[key]}: leave it out")
        if key == "vocab_size" and cfg.model.init == "random":
            raise invalid(name, value, "a random model's embedding is sized to its tokenizer: leave it out")
        if key == "is_decoder" and causal:
            raise invalid(name, value, "task=causal_lm builds every model as a decoder: leave it out")
        if key in architecture:
            raise invalid(
                name,
                value,
                f"model.architecture.{key}={architecture[key]!r} sets it too: give it in one place",
            )
    model_type = model_architecture(cfg.model).get("model_type")
    try:
        from transformers import CONFIG_MAPPING

        config_class = CONFIG_MAPPING[model_type]
        known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
        known |= set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    except Exception:  # noqa: BLE001 - a type transformers does not know (remote code): unchecked
        return
    for key, value in overrides.items():
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
            hint = f": did you mean {' or '.join(near)}?" if near else ""
            raise invalid(
                f"model.config_overrides.{key}", value, f"{config_class.__name__} has no such setting{hint}"
            )


def plain_open_overrides(overrides: list[str]) -> list[str]:
    """``model.config_overrides.key=value`` as ``++model.config_overrides.key=value``: the node is open
    (its keys are the model config's, checked by ``validate``), so the plain form sets a key whether or
    not the model's file has it."""
    from effitrain.overrides import parse

    result = []
    for text in overrides:
        plain = not str(text).startswith(("+", "~")) and str(text).startswith("model.config_overrides.")
        result.append(f"++{text}" if plain and parse([text]) else text)
    return result


def _optimizer(cfg: DictConfig) -> None:
    """Arguments against the target's signature, then the optimizer built on one dummy parameter,
    so a value the class rejects (``betas=[0.9]``) fails here rather than after the model loaded."""
    import inspect

    import torch
    from hydra.utils import get_class, instantiate

    target = cfg.optimizer.get("_target_")
    try:
        cls = get_class(target)
    except Exception:
        missing = missing_module(cfg.optimizer)
        if missing:  # an optional optimizer's package
            raise invalid(
                "optimizer._target_",
                target,
                f"needs {missing}, which is not installed: {install_hint(missing)}",
            ) from None
        raise invalid(
            "optimizer._target_", target, "no such class: give an importable optimizer class"
        ) from None
    parameters = inspect.signature(cls.__init__).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    known = [name for name in parameters if name not in ("self", "params")]
    for key in cfg.optimizer:
        if not str(key).startswith("_") and key not in parameters and not accepts_any:
            raise invalid(
                f"optimizer.{key}",
                cfg.optimizer[key],
                f"{cls.__name__} takes no such argument: choose from {', '.join(known)}",
            )
    try:
        instantiate(cfg.optimizer)([torch.nn.Parameter(torch.zeros(2, 2))])
    except Exception as error:  # the class's own check of its arguments
        from omegaconf import OmegaConf

        cause = error.__cause__ or error
        reason = str(cause).split("full_key:")[0]
        reason = " ".join(reason.split()) or type(cause).__name__
        given = {k: v for k, v in OmegaConf.to_container(cfg.optimizer).items() if not k.startswith("_")}
        raise invalid("optimizer", given, f"{cls.__name__} rejects these arguments ({reason})") from None


def model_architecture(model_cfg: DictConfig) -> dict:
    """The model's architecture config without loading it: the ``config.json`` of a local
    ``name_or_path`` for ``init=pretrained`` (or without ``model.architecture``), else
    ``model.architecture``; with ``model.config_overrides`` applied; {} when unknown."""
    from omegaconf import OmegaConf

    def plain(key) -> dict:
        node = model_cfg.get(key)
        return dict(OmegaConf.to_container(node, resolve=True)) if OmegaConf.is_config(node) else {}

    config = plain("architecture")
    local = local_config_file(model_cfg.get("name_or_path"))
    if uses_named_config(model_cfg) and local:  # as build_config
        import json

        with open(local) as handle:
            config = json.load(handle)
    config.update(plain("config_overrides"))
    return config


def local_config_file(name_or_path) -> str | None:
    """The ``config.json`` of a local model folder; None for a hub id or a folder without one."""
    path = os.path.join(os.path.expanduser(str(name_or_path or "")), "config.json")
    return path if name_or_path and os.path.isfile(path) else None


def uses_named_config(model_cfg: DictConfig) -> bool:
    """The one rule for which config a model is built from (runs, checks and estimates alike):
    ``name_or_path``'s own for ``init=pretrained``, for a local folder holding a ``config.json``
    (what is named is what is built) and when ``model.architecture`` is empty; else
    ``model.architecture`` (a model defined by its config values alone, ``init=random``)."""
    from omegaconf import OmegaConf

    node = model_cfg.get("architecture")
    architecture = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    return (
        model_cfg.get("init") != "random"
        or not architecture
        or local_config_file(model_cfg.get("name_or_path")) is not None
    )


def max_positions(model_cfg: DictConfig) -> int | None:
    """The model's position limit from its architecture config alone (no weights); None when unknown."""
    config = model_architecture(model_cfg)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def task_class(cfg: DictConfig):
    """The class the ``task`` node targets (:class:`effitrain.tasks.Classification` without one)."""
    from hydra.utils import get_class

    node = cfg.get("task")
    target = node.get("_target_") if node is not None else "effitrain.tasks.Classification"
    try:
        return get_class(target)
    except Exception:
        raise invalid("task._target_", target, "no such class: give an importable task class") from None


def _task_model(cfg: DictConfig) -> None:
    """The model type has the head the task builds (a decoder for causal_lm), from its config alone;
    with ``gradient_checkpointing=true``, a model class that can recompute its layers."""
    task, model_type, mapping = _task_mapping(cfg)
    if model_type and mapping is not None and model_type not in mapping:
        raise invalid(
            "model", cfg.model.get("name_or_path"),
            f"task={task.name} needs a model type that {task.auto_class} builds; {model_type} is not one",
        )  # fmt: skip
    if not task.uses_labels and model_type and mapping is not None:
        from transformers import AutoConfig

        from effitrain.causality import causal_check

        values = {k: v for k, v in model_architecture(cfg.model).items() if k != "model_type"}
        try:
            config = AutoConfig.for_model(model_type, **values)
        except Exception:  # noqa: BLE001 - the build reports a config it cannot make
            config = None
        if config is not None and causal_check(config, bool(cfg.model.get("trust_remote_code"))):
            raise not_causal(cfg.model.get("name_or_path"), mapping[model_type])
    unable = no_checkpointing(cfg) if cfg.get("gradient_checkpointing") is True else None
    if unable:
        raise invalid("gradient_checkpointing", True, f"{unable} cannot recompute activations: give false")


def not_causal(name_or_path, class_name: str) -> ConfigError:
    return invalid(
        "model", name_or_path,
        f"task=causal_lm needs a causal model: {class_name} lets position t see later tokens even built "
        "as a decoder (is_decoder=true), so its next-token loss would be meaningless: choose a decoder "
        "such as model=llama_small",
    )  # fmt: skip


def _task_mapping(cfg: DictConfig):
    """(task class, the model's type from its config, transformers' mapping of the model types that
    have the task's head to their class names, or None for a task without one)."""
    from transformers.models.auto import modeling_auto

    task = task_class(cfg)
    mapping = getattr(modeling_auto, getattr(task, "model_mapping", ""), None)
    return task, model_architecture(cfg.model).get("model_type"), mapping


def no_checkpointing(cfg: DictConfig) -> str | None:
    """The name of the model class the task builds when it does not support gradient checkpointing
    (transformers' ``supports_gradient_checkpointing``), from the model's config alone; None when
    it does or the class is not known before loading (remote code: the build then says so)."""
    import transformers

    _, model_type, mapping = _task_mapping(cfg)
    name = (mapping or {}).get(model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return name if cls is not None and not cls.supports_gradient_checkpointing else None


def check_max_length(cfg: DictConfig) -> None:
    """ConfigError when ``max_length`` exceeds the model's positions (for commands that do not validate)."""
    _max_length(cfg)


def _max_length(cfg: DictConfig) -> None:
    limit = max_positions(cfg.model)
    if limit is not None and cfg.max_length > limit:
        raise invalid("max_length", cfg.max_length, f"the model has {limit} positions: give at most {limit}")


def _data_files(cfg: DictConfig) -> None:
    """Local files named by ``data.load_args.data_files``: they exist, CSV headers agree and hold the
    configured columns, and the splits used are not empty. Read from the files' heads, cheaply."""
    import csv
    import glob

    from omegaconf import OmegaConf

    load_args = cfg.data.get("load_args")
    if not load_args or "data_files" not in load_args:
        return
    files = OmegaConf.to_container(load_args.data_files, resolve=True)
    if isinstance(files, (str, list)):
        files = {"train": files}
    headers = {}
    for split, paths in files.items():
        for pattern in [paths] if isinstance(paths, str) else paths:
            if "://" in str(pattern):
                continue
            matches = glob.glob(os.path.expanduser(str(pattern)))
            if not matches:
                raise invalid(f"data.load_args.data_files.{split}", pattern, "no such file")
            for path in matches:
                if load_args.get("path") == "csv" and path.endswith(".csv"):
                    with open(path, newline="") as handle:
                        rows = csv.reader(handle)
                        header = next(rows, [])
                        empty = next(rows, None) is None
                    headers[path] = header
                    used = (cfg.data.get("train_split"), cfg.data.get("eval_split"))
                    if empty and split in used:
                        raise invalid(f"data.load_args.data_files.{split}", path, "the file holds no rows")
    distinct = {tuple(h) for h in headers.values()}
    if len(distinct) > 1:
        listing = "; ".join(f"{p}: {','.join(h)}" for p, h in headers.items())
        raise invalid("data.load_args.data_files", "...", f"the CSV files' columns differ ({listing})")
    read = ("text_column", "label_column") if task_class(cfg).uses_labels else ("text_column",)
    for header in distinct:
        for key in read:
            column = cfg.data.get(key)
            if column and column not in header:
                raise invalid(f"data.{key}", column, f"no such column: choose one of {', '.join(header)}")


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


def _looks_like_path(value: str) -> bool:
    """A local path rather than a hub id (``org/name``): absolute, relative to ., or home."""
    return value.startswith(("/", "./", "../", "~")) or value.count("/") > 1


def check_output_dir(path: Path) -> None:
    """Raises ConfigError when results could not be written to ``path``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe_write(path)  # a file of its own: ranks of one job probe one folder at one moment
    except OSError as error:
        raise invalid(
            "hydra.run.dir", str(path), f"the output folder cannot be written ({error.strerror})"
        ) from None


def task_config(cfg: DictConfig, hydra_node: DictConfig, world_size: int = 1) -> DictConfig:
    """The front door of the Hydra task (a job of ``train.py``): its config with its Hydra node
    attached and ``micro_batch_size`` derived, before any tracker starts. The command line was
    validated before Hydra started (``hydra_task.preflight``); the run validates again and reports."""
    cfg = with_hydra_node(cfg, hydra_node)
    apply_effective_batch_size(cfg, world_size)
    return cfg


def with_hydra_node(cfg: DictConfig, hydra_node: DictConfig) -> DictConfig:
    """``cfg`` carrying its job's Hydra node (choices, overrides, folders), as ``compose(...,
    return_hydra_config=True)`` gives it: the Hydra task calls this once, so a run reads what Hydra
    decided from its own config and never from the HydraConfig singleton."""
    from omegaconf import open_dict

    if "hydra" not in cfg:
        with open_dict(cfg):
            cfg.hydra = hydra_node
    return cfg


# --- composition: the one way a run config is made from overrides -------------------------------


def compose(overrides: list[str]) -> DictConfig:
    """The run config ``train.py`` would compose for these overrides, typed by effitrain's schema,
    with its Hydra node (``cfg.hydra``), as Hydra's compose API gives it.

    Raises:
        ConfigError: an option that does not exist, or a value of the wrong type (one line).
    """
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

        from effitrain.schema import allowed, field_type

        cause = error.__cause__
        if isinstance(cause, ValidationError) and cause.full_key:  # a value the schema's type rejects
            allowed_values = allowed(field_type(cause.object_type, cause.key))
            raise WrongType(
                cause.full_key, invalid(cause.full_key, cause.value, allowed_values).args[0]
            ) from None
        raise ConfigError(" ".join(str(error).split())[:500]) from None
    return cfg


class WrongType(ConfigError):
    """A value the schema's type rejects (``seed=x``); ``key`` is the dotted key."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def compose_checked(overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """The composed config, and the problems of the overrides it had to leave out to compose it.

    Keys the config does not have are refused (with the nearest real keys: ``lr`` ->
    ``optimizer.lr``), and so is a ``+key`` that nothing reads. A value of the wrong type is a
    problem whose override is left out, so that the rest can still be validated: every problem
    of a command line is reported at once.

    Raises:
        ConfigError: an unknown key or option, or a grammar error: nothing to validate.
    """
    from effitrain.overrides import parse

    parsed = parse(overrides)
    groups = set(group_names())
    kept, problems = [o.input_line for o in parsed], []
    for _ in range(len(kept) + 1):
        try:
            cfg = compose(kept)
            break
        except WrongType as error:
            bad = [o.input_line for o in parse(kept) if o.key_or_group == error.key]
            if not bad:  # set by a file, not by an override: nothing to leave out
                raise
            problems.append(str(error))
            kept.remove(bad[0])
        except ConfigError:  # an unknown key, most likely: name it with the nearest real ones
            _check_keys_exist(
                compose([o.input_line for o in parsed if _is_choice(o, groups)]), parsed, groups
            )
            raise
    # composed, so every key exists; a +key outside the nodes whose keys a target reads is refused
    _check_keys_exist(cfg, [o for o in parsed if o.is_add() or o.is_force_add()], groups, added=True)
    return cfg, problems


def _is_choice(override, groups: set[str]) -> bool:
    return override.key_or_group in groups or _is_hydra(override.key_or_group)


def compose_known(overrides: list[str]) -> DictConfig:
    """:func:`compose_checked`'s config; ConfigError (ConfigErrors for several) for any problem."""
    cfg, problems = compose_checked(overrides)
    _raise(problems)
    return cfg


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
    _raise(problems)
    apply_effective_batch_size(cfg, world_size)
    return cfg


def _raise(problems: list[str]) -> None:
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigErrors(problems)


def _check_keys_exist(cfg: DictConfig, parsed, groups: set[str], added: bool = False) -> None:
    """ConfigError for the first override naming a key ``cfg`` lacks, with the nearest real keys;
    ``added``: ``cfg`` already holds the overrides' own ``+key`` additions."""
    import difflib

    from effitrain.overrides import typed_value

    adding = {o.key_or_group for o in parsed if added and (o.is_add() or o.is_force_add())}
    known = [k for k in _leaf_keys(cfg) if not k.startswith("hydra.") and k not in adding]
    for override in parsed:
        key = override.key_or_group
        if key in groups or _is_hydra(key) or override.is_delete():
            continue
        adds = override.is_add() or override.is_force_add()
        exists = _has_key(cfg, key) and not (added and adds)
        if exists or (adds and key.rpartition(".")[0] in OPEN_NODES):
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


def _leaf_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for key in node:
        path = f"{prefix}{key}"
        value = node._get_node(key)
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
