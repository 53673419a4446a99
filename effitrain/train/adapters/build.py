"""The model with its adapter: wrapped by peft for a run (:func:`apply_adapter`), and built on ``meta``
by the one function that the check, ``estimate``, ``plan`` and the replay share (:func:`model_on_meta`,
as torchtitan's estimator builds its model with training's own builders), so that what is checked is
what is estimated and what is estimated is what a run trains.

The check is that build (:func:`check_builds`, run last by :func:`effitrain.config.validate.validate`,
which the front door and a run hand it): the model class built from the architecture's values, the
adapter wrapped around it, nothing allocated. A refusal is one line naming the key: a dropout of 5 or
heads that do not divide the width (the class's own checks), target modules that match nothing or that
peft cannot wrap, ``adapter=qlora`` where bitsandbytes' 4-bit layers are unavailable.

    effitrain check adapter=lora adapter.target_modules=[query]
"""

from __future__ import annotations

from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from effitrain.config.compose import command_line_overrides
from effitrain.config.errors import ConfigError, invalid
from effitrain.config.model_spec import model_architecture, task_mapping
from effitrain.train.adapters.configs import lora_config, uses_adapter

_NAMES_SHOWN = 8  # module names a refusal lists


def apply_adapter(model, adapter_cfg: DictConfig | None, task):
    """``model`` wrapped with the node's adapter (``model`` itself for ``adapter=none``): its own
    weights frozen, the adapter's and the head's trainable. A 4-bit model goes through peft's
    ``prepare_model_for_kbit_training`` first (its layer norms and head kept in 32-bit, as peft's
    QLoRA recipe does); activation checkpointing stays effitrain's (``gradient_checkpointing``,
    non-reentrant, so no input needs ``requires_grad``).

    Raises:
        ConfigError: peft refuses ``adapter.target_modules`` (none matches, or one it cannot wrap).
    """
    if not uses_adapter(adapter_cfg):
        return model
    from peft import get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = lora_config(adapter_cfg, task, model)
    try:
        wrapped = get_peft_model(model, config)
    except (ValueError, TypeError) as error:  # peft's refusals of a target
        raise _not_wrapped(model, adapter_cfg.get("target_modules"), error) from None
    saved = getattr(config, "modules_to_save", None)
    if saved:  # a classifier's: peft appends its own "classifier" and "score" to the head named here
        config.modules_to_save = list(dict.fromkeys(saved))  # each once in the saved adapter_config.json
    return wrapped


def model_on_meta(cfg: DictConfig, task, architecture: Callable, adapted: bool = True):
    """``cfg``'s model of ``task``'s class (a task class or object: its ``auto_class``) built on
    ``meta`` from the transformers config ``architecture()`` returns, with ``cfg.adapter``'s adapter
    applied as a run applies it (``adapted``): shapes and ``requires_grad``, nothing allocated. A
    4-bit base (``qlora``) is at full precision here, as bitsandbytes quantizes only while weights
    load: :mod:`effitrain.train.adapters.replay` counts its packed codes.

    Raises:
        ConfigError: a ``quantization`` node without bitsandbytes' 4-bit layers; the model class (or
            its config) refuses the architecture's values; peft refuses the adapter's targets.
    """
    import transformers

    adapter_cfg = cfg.get("adapter") if adapted else None
    check_4bit(adapter_cfg)
    auto = getattr(transformers, task.auto_class)
    try:
        with torch.device("meta"):
            model = auto.from_config(
                architecture(), trust_remote_code=bool(cfg.model.get("trust_remote_code"))
            )
    except ConfigError:  # already one line: a key the config's own loading names
        raise
    except Exception as error:  # noqa: BLE001 - the class's own check of its config
        raise _not_built(cfg, error) from None
    with torch.device("meta"):  # peft's own layers too
        return apply_adapter(model, adapter_cfg, task)


def check_builds(cfg: DictConfig) -> None:
    """The model the task builds, its adapter applied, built on ``meta`` from the architecture's values
    alone (no weights, tokenizer, data or hub read) by :func:`model_on_meta`. A model type whose class
    is not known before loading (remote code, a hub id) is left to the build.

    Raises:
        ConfigError: one line naming the key (the command line's ``model.architecture.*`` or
            ``model.config_overrides.*`` override when one was given), the value and what is allowed.
    """
    import transformers
    from transformers import AutoConfig

    task, model_type, mapping = task_mapping(cfg)
    if getattr(transformers, str((mapping or {}).get(model_type)), None) is None:
        check_4bit(cfg.get("adapter"))
        return
    values = {k: v for k, v in model_architecture(cfg.model).items() if k != "model_type"}

    def architecture():
        config = AutoConfig.for_model(model_type, **values)
        if not task.uses_labels:  # a causal LM is built as a decoder, as the run builds it (build_config)
            config.is_decoder = True
        return config

    model_on_meta(cfg, task, architecture)


def bitsandbytes_4bit_available() -> bool:
    """transformers' own test of what its 4-bit loading needs (bitsandbytes installed and a backend)."""
    from transformers.utils import is_bitsandbytes_available

    return is_bitsandbytes_available()


def check_4bit(adapter_cfg: DictConfig | None) -> None:
    """bitsandbytes' 4-bit layers are available for the node's ``quantization`` (``adapter=qlora``).

    Raises:
        ConfigError: they are not.
    """
    if uses_adapter(adapter_cfg) and adapter_cfg.get("quantization") is not None:
        if not bitsandbytes_4bit_available():
            raise invalid(
                "adapter", "qlora", "needs bitsandbytes' 4-bit layers, unavailable here: install "
                "bitsandbytes, or use adapter=lora",
            )  # fmt: skip


def parameter_counts(model) -> tuple[int, int]:
    """(all the model's weights, those that train): an adapted model counted by peft, which counts a
    4-bit weight's parameters, not the bytes its packed codes fill."""
    if hasattr(model, "get_nb_trainable_parameters"):  # an AdaptedModel
        trainable, total = model.get_nb_trainable_parameters()
        return total, trainable
    parameters = list(model.parameters())
    return sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad)


def keep_cpu_layout(model) -> None:
    """Turn off bitsandbytes' CPU inference path (on CPUs with AVX512-BF16): at the first forward
    without gradients (an evaluation) it repacks a 4-bit layer's weight in place and sets its compute
    dtype to bfloat16, so training after an evaluation would run on other storages than before, and
    it fails on a layer narrower than one quantization block (the tiny test models)."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def _not_built(cfg: DictConfig, error: Exception):
    """The class's refusal of the architecture's values, named by the command line's override of
    ``model.architecture.*`` or ``model.config_overrides.*`` when exactly one was given."""
    _, model_type, mapping = task_mapping(cfg)
    name = (mapping or {}).get(model_type) or "the model class"
    reason = " ".join(str(error).split()) or type(error).__name__
    given = [
        o
        for o in command_line_overrides(cfg)
        if o.key_or_group.startswith(("model.architecture.", "model.config_overrides."))
    ]
    values = {k: v for k, v in model_architecture(cfg.model).items() if k != "model_type"}
    key, value = (given[0].key_or_group, given[0].value()) if len(given) == 1 else ("model", values)
    return invalid(key, value, f"{name} cannot be built with it ({reason[:300]})")


def _not_wrapped(model, targets, error: Exception):
    """peft's refusal of ``adapter.target_modules``: a name that matches nothing (the model's Linear
    layers listed), or a module of a type peft cannot wrap (peft's first sentence names it)."""
    shown = OmegaConf.to_container(targets) if OmegaConf.is_config(targets) else targets
    reason = " ".join(str(error).split())
    if "not found in the base model" in reason or "No modules were targeted" in reason:
        names = sorted({name.rpartition(".")[2] for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)})  # fmt: skip
        return invalid(
            "adapter.target_modules", shown,
            f"matches no module of {type(model).__name__}: give all-linear or names it has, such as "
            f"{', '.join(names[:_NAMES_SHOWN])}",
        )  # fmt: skip
    return invalid("adapter.target_modules", shown, f"peft cannot wrap it: {reason.split('. ')[0]}")
