"""What a config says a model is, read from the config alone (no weights, nothing built): its
architecture values, whether its named config or ``model.architecture`` builds it, its position
limit, the task's class and the model class the task builds for it. Runs, checks and estimates
read these, so they agree on what is built."""

from __future__ import annotations

import os

from omegaconf import DictConfig

from effitrain.config.errors import invalid


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
    """The class the ``task`` node targets (:class:`effitrain.train.tasks.Classification` without one)."""
    from hydra.utils import get_class

    node = cfg.get("task")
    target = node.get("_target_") if node is not None else "effitrain.train.tasks.Classification"
    try:
        return get_class(target)
    except Exception:
        raise invalid("task._target_", target, "no such class: give an importable task class") from None


def task_mapping(cfg: DictConfig):
    """(task class, the model's type from its config, transformers' mapping of the model types that
    have the task's head to their class names, or None for a task without one)."""
    from transformers.models.auto import modeling_auto

    task = task_class(cfg)
    mapping = getattr(modeling_auto, getattr(task, "model_mapping", ""), None)
    return task, model_architecture(cfg.model).get("model_type"), mapping
