"""Parameter-efficient fine-tuning: the ``adapter`` config group (``conf/adapter/``) turned into peft's and
bitsandbytes' objects. ``adapter=none`` trains every weight; ``lora`` and ``dora`` freeze the model and
train peft's low-rank updates beside its Linear layers; ``qlora`` also holds the frozen base in 4-bit NF4
(transformers' ``BitsAndBytesConfig``). The adapter math and the quantization are peft's and
bitsandbytes'; this module only builds their configs and calls them:

* :func:`quantization_config`: what ``from_pretrained`` is given (None: full-precision weights), and
  :func:`keeping_head`: it with the model's head left in full precision;
* :func:`lora_config`: the ``peft.LoraConfig`` of the node, its ``task_type`` the task's, so that peft
  trains a classification head in full (``modules_to_save``: the whole head, found from the model);
* :func:`apply_adapter`: the model wrapped by ``peft.get_peft_model``.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from effitrain.config.adapter import head_modules, lora_config

# The dtype the 4-bit layers compute in, by precision.mixed_precision.
COMPUTE_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def uses_adapter(adapter_cfg: DictConfig | None) -> bool:
    """The node builds an adapter (``adapter=none``'s target is null)."""
    return adapter_cfg is not None and bool(adapter_cfg.get("_target_"))


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


def apply_adapter(model, adapter_cfg: DictConfig | None, task):
    """``model`` wrapped with the node's adapter (``model`` itself for ``adapter=none``): its own
    weights frozen, the adapter's and the head's trainable. A 4-bit model goes through peft's
    ``prepare_model_for_kbit_training`` first (its layer norms and head kept in 32-bit, as peft's
    QLoRA recipe does); activation checkpointing stays effitrain's (``gradient_checkpointing``,
    non-reentrant, so no input needs ``requires_grad``)."""
    if not uses_adapter(adapter_cfg):
        return model
    from peft import get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, lora_config(adapter_cfg, task, model))


def parameter_counts(model) -> tuple[int, int]:
    """(all the model's weights, those that train): an adapted model counted by peft, which counts a
    4-bit weight's parameters, not the bytes its packed codes fill."""
    if hasattr(model, "get_nb_trainable_parameters"):
        trainable, total = model.get_nb_trainable_parameters()
        return total, trainable
    parameters = list(model.parameters())
    return sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad)


def save_adapter(model, folder) -> bool:
    """An adapted model's checkpoint weights, as peft saves them (``adapter_config.json``,
    ``adapter_model.safetensors``: the adapter's weights and the head it trains), so that
    ``PeftModel.from_pretrained(base, folder)`` and the Trainer's resume load a checkpoint as it is.
    The frozen base is not saved: a run rebuilds it as it did (the same weights, the same seed, the
    same quantization). False, and nothing written, for a model without an adapter."""
    if not hasattr(model, "peft_config"):
        return False
    model.save_pretrained(folder)
    return True


def load_adapter(model, folder, device) -> bool:
    """The weights :func:`save_adapter` saved in ``folder`` loaded into ``model`` (peft's
    ``set_peft_model_state_dict``); False for a model without an adapter.

    Raises:
        RuntimeError: the file holds weights the model has no place for.
    """
    if not hasattr(model, "peft_config"):
        return False
    from peft import set_peft_model_state_dict
    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import load_file

    state = load_file(folder / SAFETENSORS_WEIGHTS_NAME, device=str(device))
    unexpected = set_peft_model_state_dict(model, state).unexpected_keys
    if unexpected:
        raise RuntimeError(
            f"{folder / SAFETENSORS_WEIGHTS_NAME} holds weights the model lacks: {unexpected[:3]}"
        )
    return True


def keep_cpu_layout(model) -> None:
    """Turn off bitsandbytes' CPU inference path (on CPUs with AVX512-BF16): at the first forward
    without gradients (an evaluation) it repacks a 4-bit layer's weight in place and sets its compute
    dtype to bfloat16, so training after an evaluation would run on other storages than before, and
    it fails on a layer narrower than one quantization block (the tiny test models)."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
