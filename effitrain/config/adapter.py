"""Checks of the ``adapter`` group before a model loads: the adapter wrapped around the model built on
``meta`` (shapes only, nothing allocated), so target modules that match nothing, or a module peft
cannot wrap, fail in one line; and ``adapter=qlora`` refused where bitsandbytes' 4-bit layers are
unavailable. The ranges of ``r``, ``lora_alpha``, ``lora_dropout`` and ``lr`` are the schema's
(:class:`effitrain.config.schema.AdapterSettings`).

Also what an adapter decides beyond peft's config: the classification head it trains in full
(:func:`head_modules`, found from the model) and the learning rate it trains at (:func:`apply_adapter_lr`).
"""

from __future__ import annotations

import math
import re

from omegaconf import DictConfig, OmegaConf, open_dict

from effitrain.config.errors import invalid
from effitrain.config.model_spec import model_architecture, task_mapping
from effitrain.config.targets import READ_BY_EFFITRAIN

# peft's task type by the task's model class: peft puts a SEQ_CLS model's head in modules_to_save.
PEFT_TASK_TYPES = {
    "AutoModelForSequenceClassification": "SEQ_CLS",
    "AutoModelForCausalLM": "CAUSAL_LM",
}
_NAMES_SHOWN = 8  # module names a refusal lists


def check_adapter(cfg: DictConfig) -> None:
    """The adapter node wraps the model: bitsandbytes' 4-bit loading is available for a
    ``quantization`` node, and peft wraps the task's model class built on ``meta`` from the
    architecture (a model type whose class is not known before loading is left to the run).

    Raises:
        ConfigError: one line naming the key, the value and what is allowed.
    """
    adapter = cfg.get("adapter")
    if adapter is None or not adapter.get("_target_"):
        return
    if adapter.get("quantization") is not None:
        _check_4bit()
    _check_wraps(cfg, adapter)


def lora_config(adapter_cfg: DictConfig, task, model):
    """The node's ``peft.LoraConfig`` (effitrain's own keys aside) for ``task``'s model class (a task
    class or object: its ``auto_class``); for a classifier, ``model``'s whole head
    (:func:`head_modules`) trains in full and gets no LoRA, unless ``modules_to_save`` or
    ``exclude_modules`` is given."""
    from hydra.utils import instantiate

    node = OmegaConf.to_container(adapter_cfg, resolve=True)
    for key in READ_BY_EFFITRAIN["adapter"]:
        node.pop(key, None)
    task_type = PEFT_TASK_TYPES[task.auto_class]
    if task_type == "SEQ_CLS":
        head = head_modules(model)
        node.setdefault("modules_to_save", head)
        # a module and everything in it, by its full name: peft cannot wrap a module both ways
        node.setdefault("exclude_modules", rf"({'|'.join(map(re.escape, head))})(\..*)?")
    return instantiate(node, task_type=task_type, _convert_="all")


def head_modules(model) -> list[str]:
    """The full names of ``model``'s head (a transformers task model): every module between the base
    model's output and the logits, so that an adapter trains it in full and a 4-bit base leaves it in
    full precision. That is each module beside the base model that holds weights (``classifier``,
    ``score``, distilbert's ``pre_classifier``, a causal LM's ``lm_head``) and the base model's
    ``pooler`` (bert's), which reads the encoder's output for the head alone."""
    import torch

    prefix = model.base_model_prefix
    base = getattr(model, prefix, None)
    beside = [(name, module) for name, module in model.named_children() if module is not base]
    pooler = getattr(base, "pooler", None)
    if isinstance(pooler, torch.nn.Module):
        beside.insert(0, (f"{prefix}.pooler", pooler))
    return [name for name, module in beside if next(module.parameters(), None) is not None]


def apply_adapter_lr(cfg: DictConfig) -> bool:
    """An adapter's ``lr`` made the optimizer's (``optimizer.lr``), unless the command line sets
    ``optimizer.lr`` itself; True if it changed. LoRA's updates start at zero and are scaled by
    ``lora_alpha / r``: they need a higher learning rate than full fine-tuning's to move in as many
    steps, so the adapter group carries its own and the run's summary (``cfg/lr``) shows the one used."""
    from effitrain.config.compose import command_line_overrides

    adapter = cfg.get("adapter")
    lr = adapter.get("lr") if adapter is not None and adapter.get("_target_") else None
    # a value the validation refuses is left for it to name as adapter.lr, not copied to optimizer.lr
    usable = isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0
    if not usable or cfg.optimizer.get("lr") == lr:
        return False
    if any(o.key_or_group == "optimizer.lr" for o in command_line_overrides(cfg)):
        return False
    with open_dict(cfg):
        cfg.optimizer.lr = lr
    return True


def bitsandbytes_4bit_available() -> bool:
    """transformers' own test of what its 4-bit loading needs (bitsandbytes installed and a backend)."""
    from transformers.utils import is_bitsandbytes_available

    return is_bitsandbytes_available()


def _check_4bit() -> None:
    if not bitsandbytes_4bit_available():
        raise invalid(
            "adapter", "qlora", "needs bitsandbytes' 4-bit layers, unavailable here: install bitsandbytes, "
            "or use adapter=lora",
        )  # fmt: skip


def _check_wraps(cfg: DictConfig, adapter: DictConfig) -> None:
    import torch
    import transformers
    from peft import get_peft_model
    from transformers import AutoConfig

    task, model_type, mapping = task_mapping(cfg)
    model_class = getattr(transformers, str((mapping or {}).get(model_type)), None)
    if model_class is None:
        return
    values = {k: v for k, v in model_architecture(cfg.model).items() if k != "model_type"}
    with torch.device("meta"):
        model = model_class(AutoConfig.for_model(model_type, **values))
    lora = lora_config(adapter, task, model)
    targets = adapter.get("target_modules")
    shown = OmegaConf.to_container(targets) if OmegaConf.is_config(targets) else targets
    try:
        get_peft_model(model, lora)
    except (ValueError, TypeError) as error:  # peft's refusals of a target
        reason = " ".join(str(error).split())
        if "not found in the base model" in reason or "No modules were targeted" in reason:
            names = sorted({name.rpartition(".")[2] for name, m in model.named_modules()
                            if isinstance(m, torch.nn.Linear)})  # fmt: skip
            raise invalid(
                "adapter.target_modules", shown,
                f"matches no module of {model_class.__name__}: give all-linear or names it has, such as "
                f"{', '.join(names[:_NAMES_SHOWN])}",
            ) from None  # fmt: skip
        # peft's first sentence names the module and its type; the list of supported types follows
        raise invalid(
            "adapter.target_modules", shown, f"peft cannot wrap it: {reason.split('. ')[0]}"
        ) from None
