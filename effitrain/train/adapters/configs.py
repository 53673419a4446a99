"""What peft and bitsandbytes are given: an ``adapter`` node (``conf/adapter/``) turned into peft's config
(:func:`lora_config`: any peft ``*Config`` the node targets, its ``task_type`` the task's) and
transformers' ``BitsAndBytesConfig`` (:func:`quantization_config`, :func:`keeping_head`), and the one
thing an adapter decides beyond them: the classification head it trains in full, found from the model
(:func:`head_modules`).
"""

from __future__ import annotations

import re

import torch
from omegaconf import DictConfig, OmegaConf

from effitrain.config.targets import READ_BY_EFFITRAIN

# peft's task type by the task's model class: peft puts a SEQ_CLS model's head in modules_to_save.
PEFT_TASK_TYPES = {
    "AutoModelForSequenceClassification": "SEQ_CLS",
    "AutoModelForCausalLM": "CAUSAL_LM",
}
# The dtype the 4-bit layers compute in, by precision.mixed_precision.
COMPUTE_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def uses_adapter(adapter_cfg: DictConfig | None) -> bool:
    """The node builds an adapter (``adapter=none``'s target is null)."""
    return adapter_cfg is not None and bool(adapter_cfg.get("_target_"))


def lora_config(adapter_cfg: DictConfig, task, model):
    """The node's peft config (``peft.LoraConfig``, or any peft ``*Config`` it targets; effitrain's own
    keys aside) for ``task``'s model class (a task class or object: its ``auto_class``); for a
    classifier, ``model``'s whole head (:func:`head_modules`) trains in full and gets no adapter,
    unless ``modules_to_save`` or ``exclude_modules`` is given (``exclude_modules`` where the config
    class takes it: VeRA's does not)."""
    import inspect

    from hydra.utils import get_class, instantiate

    node = OmegaConf.to_container(adapter_cfg, resolve=True)
    for key in READ_BY_EFFITRAIN["adapter"]:
        node.pop(key, None)
    task_type = PEFT_TASK_TYPES[task.auto_class]
    if task_type == "SEQ_CLS":
        head = head_modules(model)
        node.setdefault("modules_to_save", head)
        if "exclude_modules" in inspect.signature(get_class(node["_target_"])).parameters:
            # a module and everything in it, by its full name: peft cannot wrap a module both ways
            node.setdefault("exclude_modules", rf"({'|'.join(map(re.escape, head))})(\..*)?")
    return instantiate(node, task_type=task_type, _convert_="all")


def head_modules(model) -> list[str]:
    """The full names of ``model``'s head (a transformers task model): every module between the base
    model's output and the logits, so that an adapter trains it in full and a 4-bit base leaves it in
    full precision. That is each module beside the base model that holds weights (``classifier``,
    ``score``, distilbert's ``pre_classifier``, a causal LM's ``lm_head``) and the base model's
    ``pooler`` (bert's), which reads the encoder's output for the head alone."""
    prefix = model.base_model_prefix
    base = getattr(model, prefix, None)
    beside = [(name, module) for name, module in model.named_children() if module is not base]
    pooler = getattr(base, "pooler", None)
    if isinstance(pooler, torch.nn.Module):
        beside.insert(0, (f"{prefix}.pooler", pooler))
    return [name for name, module in beside if next(module.parameters(), None) is not None]


def quantization_config(adapter_cfg: DictConfig | None, mixed_precision: str):
    """The ``BitsAndBytesConfig`` of the node's ``quantization`` (``adapter=qlora``), computing in
    ``mixed_precision``'s dtype (``precision.mixed_precision``: no, bf16, fp16); None without one."""
    from hydra.utils import instantiate

    node = adapter_cfg.get("quantization") if adapter_cfg is not None else None
    if node is None:
        return None
    return instantiate(node, bnb_4bit_compute_dtype=COMPUTE_DTYPES[str(mixed_precision)], _convert_="all")


def keeping_head(quantization, model):
    """``quantization`` (a ``BitsAndBytesConfig``, or None) with ``model``'s head (:func:`head_modules`,
    by full name: transformers matches a skipped name from the start or as a suffix, so bert's
    ``pooler`` alone would miss ``bert.pooler.dense``) among the modules it leaves in full precision:
    the head trains in full, which a 4-bit weight cannot."""
    if quantization is None:
        return None
    import copy

    kept = copy.deepcopy(quantization)
    skipped = list(kept.llm_int8_skip_modules or [])
    kept.llm_int8_skip_modules = skipped + [name for name in head_modules(model) if name not in skipped]
    return kept
