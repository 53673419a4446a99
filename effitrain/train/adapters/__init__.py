"""Adapters: parameter-efficient fine-tuning, in one place. ``adapter=none`` (the default) trains every
weight; ``lora`` and ``dora`` freeze the model and train peft's low-rank updates beside its Linear
layers; ``qlora`` also holds the frozen base in 4-bit NF4 (bitsandbytes, through transformers'
``BitsAndBytesConfig``). The math and the quantization are peft's and bitsandbytes'; effitrain builds
their configs, calls them, checks them before a run and predicts their memory.

What an adapter is, for effitrain: a node of the ``adapter`` config group (``conf/adapter/*.yaml``) whose
``_target_`` is a peft config class (the group's allow-list: any ``peft.*``), optionally with a
``quantization`` node and an ``lr``; and a model wrapped by it that is an :class:`AdaptedModel`.

* :mod:`.configs`: the node turned into peft's config (its ``task_type`` the task's, the classifier's
  head trained in full, found from the model) and bitsandbytes' (the head kept in full precision);
* :mod:`.build`: the model wrapped for a run, the one build on ``meta`` that check, ``estimate``,
  ``plan`` and the replay share, and the check that is that build;
* :mod:`.files`: the adapter's checkpoint files (peft's own);
* :mod:`.replay`: what the fake-tensor replay needs (peft cannot wrap fake tensors; a 4-bit base is
  counted by the storages it holds).

An adapter's keys outside these modules are the config layer's, read without torch: its settings'
ranges (``config.schema.AdapterSettings``), the keys effitrain reads or supplies itself
(``config.targets``), its learning rate made the optimizer's (``config.load.apply_adapter_lr``).
A new kind (IA3, VeRA) is a YAML file (docs/extending.md, "Adding an adapter kind").
"""

from __future__ import annotations

from typing import Protocol, TypeGuard, runtime_checkable


@runtime_checkable
class AdaptedModel(Protocol):
    """A model an adapter wraps (peft's ``PeftModel``), as effitrain uses it: its adapter's config,
    peft's count of what trains, and its own checkpoint files (the adapter only, never the base)."""

    peft_config: dict

    def get_nb_trainable_parameters(self) -> tuple[int, int]: ...

    def save_pretrained(self, folder, **kwargs) -> None: ...


def is_adapted(model) -> TypeGuard[AdaptedModel]:
    """``model`` is wrapped by an adapter: it holds peft's config (read through a compiled module too)."""
    return hasattr(model, "peft_config")
