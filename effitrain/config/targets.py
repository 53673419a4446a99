"""Checks of what a config group's target will build, before it is built.

:func:`check_targets` is the one check of every ``_target_`` node's keys (as torchtune's
``config/_validate.py``): each key is an argument its target takes, for every group (optimizer,
lr_scheduler, data, backend, logger, task, and a node a user's own config adds). The others check
values: the model's paths and weights, its config keys, the optimizer's arguments on one parameter,
the model type against the task, the sequence length against the model's positions, and local data
files. :func:`effitrain.config.validate.validate` runs them. Each raises a :class:`ConfigError` whose
message is one line naming the key."""

from __future__ import annotations

import os

from omegaconf import DictConfig

from effitrain.config.compose import command_line_overrides
from effitrain.config.errors import ConfigError, invalid, raise_problems
from effitrain.config.model_spec import (
    local_config_file,
    max_positions,
    model_architecture,
    task_class,
    task_mapping,
    uses_named_config,
)
from effitrain.config.registry import (
    CONF_DIR,
    GROUP_TARGETS,
    check_allowed,
    check_kind,
    install_hint,
    is_target_node,
    missing_module,
    target_definition,
)
from effitrain.config.techniques import check_techniques
from effitrain.util.compat import config_node, dynamo_left_unimported

# Hydra's own keys of a node it instantiates: never an argument of the target.
HYDRA_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")

# Keys of a target node that effitrain reads itself and leaves out when it instantiates the node.
READ_BY_EFFITRAIN = {
    "data": ("packing",),  # the task's (tasks.data_node): causal_lm packs rows
    # the weights' loading (adapters.configs.quantization_config), the optimizer's lr (load.apply_adapter_lr)
    "adapter": ("quantization", "lr"),
}

# Arguments effitrain passes itself when it calls a group's target (optim.build_optimizer and
# build_scheduler, the run's backend, loggers.build_tracker), and what decides each: a key naming
# one would be replaced or would clash.
SUPPLIED_BY_EFFITRAIN = {
    "optimizer": {
        "params": "effitrain passes the model's parameter groups: leave it out",
        "weight_decay": "the root key weight_decay sets it per parameter group: give weight_decay instead",
    },
    "lr_scheduler": {
        "optimizer": "effitrain passes the optimizer it built: leave it out",
        "num_warmup_steps": "warmup_ratio decides it: give warmup_ratio instead",
        "num_training_steps": "epochs and max_steps decide it: give those instead",
    },
    "backend": {"job": "effitrain passes the job it built: leave it out"},
    "adapter": {"task_type": "the task decides it (SEQ_CLS or CAUSAL_LM): leave it out"},
    "adapter.quantization": {"bnb_4bit_compute_dtype": "precision decides it: give precision instead"},
    "logger": {
        "config": "effitrain passes the run's config: leave it out",
        "identity": "effitrain passes the job's group, name and tags: leave it out",
    },
}


# Nodes whose target is called with the node's own keys and nothing else (effitrain.train.tasks.data_node
# only fills keys the node has): every required parameter must be among them, or the run fails after
# loading what comes before the data.
CALLED_WITH_ITS_KEYS_ONLY = ("data",)
# (Hydra's callbacks too, but a callback's parameters all have defaults in practice; left to Hydra.)


def check_targets(cfg: DictConfig, allowed=GROUP_TARGETS) -> None:
    """Every ``_target_`` node (``hydra`` aside) is one its group ``allowed`` (read from the name,
    before anything is imported: :func:`effitrain.config.registry.check_allowed`), names something
    importable of the group's kind, and its keys bind to the target's parameters
    (``inspect.Signature.bind_partial``: arguments effitrain or Hydra pass later may be absent). A
    target taking ``**kwargs`` accepts any key: its own check, when it is built, is the only one. A
    target whose package is not installed is named with the extra that installs it.

    Raises:
        ConfigError: one line per node (ConfigErrors for several), naming the full dotted key, the
            value and the target's arguments.
    """
    problems = []
    for path, node in target_nodes(cfg):
        try:
            _check_target(path, node, allowed)
        except ConfigError as error:
            problems.append(str(error))
    raise_problems(problems)


def target_nodes(node: DictConfig, prefix: str = ""):
    """(dotted path, node) of every node under ``node`` whose ``_target_`` names something, outside
    Hydra's own node but for its callbacks (``hydra.callbacks.<name>``); a node inside another's
    arguments, or in a list, too."""
    from omegaconf import ListConfig, OmegaConf

    for key in range(len(node)) if isinstance(node, ListConfig) else list(node):
        if not prefix and key == "hydra":
            callbacks = OmegaConf.select(node, "hydra.callbacks", default=None)
            for name in callbacks or {}:
                if is_target_node(config_node(callbacks, name)):
                    yield f"hydra.callbacks.{name}", config_node(callbacks, name)
            continue
        if OmegaConf.is_missing(node, key):
            continue
        child = config_node(node, key)
        if isinstance(child, (DictConfig, ListConfig)) and node.get(key) is not None:
            path = f"{prefix}{key}"
            if is_target_node(child):
                yield path, child
            yield from target_nodes(child, f"{path}.")


def _check_target(path: str, node: DictConfig, allowed) -> None:
    from omegaconf import OmegaConf

    target = node._target_
    check_allowed(path, target, allowed)
    try:
        signature, found = target_definition(target)
    except ImportError as error:
        missing = missing_module(node)
        if missing:  # an optional package
            raise invalid(
                f"{path}._target_",
                target,
                f"needs {missing}, which is not installed: {install_hint(missing)}",
            ) from None
        raise invalid(f"{path}._target_", target, f"{error}: give an importable class or function") from None
    check_kind(path, target, found, allowed)
    if signature is None:  # a builtin: no arguments to bind them to
        return
    name = target.rpartition(".")[2]
    supplied = SUPPLIED_BY_EFFITRAIN.get(path, {})
    keys = [
        str(k) for k in node if str(k) not in HYDRA_KEYS and str(k) not in READ_BY_EFFITRAIN.get(path, ())
    ]
    allowed = [
        p.name
        for p in signature.parameters.values()
        if p.kind not in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in supplied
    ]
    for key in keys:
        if key in supplied:
            raise invalid(f"{path}.{key}", _shown(node, key), supplied[key])
        try:
            signature.bind_partial(**{key: None})
        except TypeError:
            choices = f"choose from {', '.join(allowed)}" if allowed else "it takes none from the config"
            raise invalid(
                f"{path}.{key}", _shown(node, key), f"{name} takes no such argument: {choices}"
            ) from None
    try:
        signature.bind_partial(*node.get("_args_", []), **dict.fromkeys(keys))
    except TypeError as error:  # a key given twice: by name and as a positional _args_ value
        raise invalid(path, OmegaConf.to_container(node, resolve=False), f"{name}: {error}") from None
    if path in CALLED_WITH_ITS_KEYS_ONLY:
        given = {*keys, *(p.name for p, _ in zip(signature.parameters.values(), node.get("_args_", [])))}
        for parameter in signature.parameters.values():
            required = parameter.default is parameter.empty and parameter.kind in (
                parameter.POSITIONAL_OR_KEYWORD,
                parameter.KEYWORD_ONLY,
            )
            if required and parameter.name not in given:
                raise ConfigError(
                    f"{path}.{parameter.name} is missing: {name} needs it (a deleted key, ~{path}.{parameter.name}?): "
                    f"give {path}.{parameter.name}=<value>"
                )


def _shown(node: DictConfig, key: str):
    """The value of ``node[key]`` as the user gave it: resolved, plain Python."""
    from omegaconf import OmegaConf

    try:
        value = node[key]
    except Exception:  # noqa: BLE001 - an interpolation that does not resolve: its text
        return OmegaConf.to_container(node, resolve=False)[key]
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def check_model(cfg: DictConfig) -> None:
    # model.init and trust_remote_code are typed by the schema: composition has checked them
    for key in ("name_or_path", "tokenizer"):
        value = cfg.model.get(key)
        if value and looks_like_path(value) and not os.path.exists(os.path.expanduser(value)):
            raise invalid(f"model.{key}", value, "no such folder (give an existing path or a hub id)")


def check_weights(cfg: DictConfig) -> None:
    if cfg.model.get("init") == "pretrained" and not has_weights(str(cfg.model.get("name_or_path"))):
        raise invalid(
            "model.init", "pretrained",
            f"model.name_or_path={cfg.model.get('name_or_path')!r} has no weights here (no *.safetensors or "
            "*.bin in the folder, or the hub id is neither reachable nor cached): give model.init=random",
        )  # fmt: skip


def has_weights(name_or_path: str) -> bool:
    """Pretrained weights can be loaded: a local folder holding weight files, or a hub id that is
    cached or reachable (a local path that does not exist is ``check_model``'s to name)."""
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        names = os.listdir(path)
        return any(n.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json")) for n in names)
    if looks_like_path(name_or_path):
        return True
    from effitrain.util.assets import hub_unreachable

    if not hub_unreachable():
        return True  # the hub answers: its own error names a missing repository
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name_or_path, "config.json"), str)
    except Exception:  # noqa: BLE001 - not a valid repository id
        return False


def check_named_is_built(cfg: DictConfig) -> None:
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
    if uses_named_config(model) or (looks_like_path(name) and not os.path.exists(os.path.expanduser(name))):
        return  # a path that does not exist: check_model names it
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


def check_config_overrides(cfg: DictConfig) -> None:
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
        known.add("attn_implementation")  # every config takes it (PretrainedConfig stores it privately)
    except Exception:  # noqa: BLE001 - a type transformers does not know (remote code): unchecked
        return
    # never suggested as they are: a key refused above (an architecture's key is named where it is set)
    refused = set(SET_BY_EFFITRAIN) | ({"vocab_size"} if cfg.model.init == "random" else set())
    refused |= {"is_decoder"} if causal else set()
    for key, value in overrides.items():
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known - refused), n=3, cutoff=0.6)
            near = [f"model.architecture.{name}" if name in architecture else name for name in near]
            hint = f": did you mean {' or '.join(near)}?" if near else ""
            raise invalid(
                f"model.config_overrides.{key}", value, f"{config_class.__name__} has no such setting{hint}"
            )


def check_optimizer(cfg: DictConfig) -> None:
    """The optimizer built on one dummy parameter, so a value the class rejects (``betas=[0.9]``)
    fails here rather than after the model loaded (its keys are :func:`check_targets`'s)."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    name = str(cfg.optimizer._target_).rpartition(".")[2]
    try:
        with dynamo_left_unimported():  # the optimizer is dropped at once: no need of dynamo's wrapping
            instantiate(cfg.optimizer)([torch.nn.Parameter(torch.zeros(2, 2))])
    except Exception as error:  # the class's own check of its arguments
        cause = error.__cause__ or error
        reason = str(cause).split("full_key:")[0]
        reason = " ".join(reason.split()) or type(cause).__name__
        given = {k: v for k, v in OmegaConf.to_container(cfg.optimizer).items() if not k.startswith("_")}
        raise invalid("optimizer", given, f"{name} rejects these arguments ({reason})") from None


def check_task_model(cfg: DictConfig) -> None:
    """The model type has the head the task builds (a decoder for causal_lm), from its config alone;
    then each memory technique's check (``gradient_checkpointing=true``: a model class that can
    recompute its layers)."""
    task, model_type, mapping = task_mapping(cfg)
    if model_type and mapping is not None and model_type not in mapping:
        raise invalid(
            "model", cfg.model.get("name_or_path"),
            f"task={task.name} needs a model type that {task.auto_class} builds; {model_type} is not one",
        )  # fmt: skip
    if not task.uses_labels and model_type and mapping is not None:
        from transformers import AutoConfig

        from effitrain.config.causality import causal_check

        values = {k: v for k, v in model_architecture(cfg.model).items() if k != "model_type"}
        try:
            config = AutoConfig.for_model(model_type, **values)
        except Exception:  # noqa: BLE001 - the build reports a config it cannot make
            config = None
        if config is not None and causal_check(config, bool(cfg.model.get("trust_remote_code"))):
            raise not_causal(cfg.model.get("name_or_path"), mapping[model_type])
    check_techniques(cfg)  # each memory technique's own check (gradient_checkpointing's model class)


def not_causal(name_or_path, class_name: str) -> ConfigError:
    return invalid(
        "model", name_or_path,
        f"task=causal_lm needs a causal model: {class_name} lets position t see later tokens even built "
        "as a decoder (is_decoder=true), so its next-token loss would be meaningless: choose a decoder "
        "such as model=llama_small",
    )  # fmt: skip


def check_max_length(cfg: DictConfig) -> None:
    """ConfigError when ``max_length`` exceeds the model's positions (``validate`` and the commands
    that do not validate call it)."""
    limit = max_positions(cfg.model)
    if limit is not None and cfg.max_length > limit:
        raise invalid("max_length", cfg.max_length, f"the model has {limit} positions: give at most {limit}")


def looks_like_path(value: str) -> bool:
    """A local path rather than a hub id (``org/name``): absolute, relative to ., or home."""
    return value.startswith(("/", "./", "../", "~")) or value.count("/") > 1
