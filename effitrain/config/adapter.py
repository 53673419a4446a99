"""Checks of the ``adapter`` group before a model loads: the adapter wrapped around the model built on
``meta`` (shapes only, nothing allocated), so target modules that match nothing, or a module peft
cannot wrap, fail in one line; and ``adapter=qlora`` refused where bitsandbytes' 4-bit layers are
unavailable. The ranges of ``r``, ``lora_alpha`` and ``lora_dropout`` are the schema's
(:class:`effitrain.config.schema.AdapterSettings`)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from effitrain.config.errors import invalid
from effitrain.config.model_spec import model_architecture, task_mapping

# peft's task type by the task's model class: peft puts a SEQ_CLS model's head in modules_to_save.
PEFT_TASK_TYPES = {
    "AutoModelForSequenceClassification": "SEQ_CLS",
    "AutoModelForCausalLM": "CAUSAL_LM",
}
# What peft trains in full for SEQ_CLS (its modules_to_save, matched as name endings: distilbert's
# pre_classifier too), as a regex for LoraConfig's exclude_modules: peft cannot wrap a module both ways.
CLASSIFIER_MODULES = r".*(classifier|score)"
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


def lora_config(adapter_cfg: DictConfig, task):
    """The node's ``peft.LoraConfig`` (its ``quantization`` aside) for ``task``'s model class (a task
    class or object: its ``auto_class``); for a classifier, the modules peft trains in full get no
    LoRA (unless ``exclude_modules`` is given)."""
    from hydra.utils import instantiate

    node = OmegaConf.to_container(adapter_cfg, resolve=True)
    node.pop("quantization", None)
    task_type = PEFT_TASK_TYPES[task.auto_class]
    if task_type == "SEQ_CLS":
        node.setdefault("exclude_modules", CLASSIFIER_MODULES)
    return instantiate(node, task_type=task_type, _convert_="all")


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
    lora = lora_config(adapter, task)
    with torch.device("meta"):
        model = model_class(AutoConfig.for_model(model_type, **values))
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
