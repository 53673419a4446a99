"""The model a replay runs, its adapter included (``adapter=lora``, ``dora``): the step peak of an adapted
model is predicted by the same fake-tensor replay as a full fine-tuning's (:mod:`effitrain.memory.replay`).

peft cannot wrap a model made of fake tensors (moving an adapter to its base layer's device swaps
tensors, which fake ones refuse), so the model is built and wrapped on ``meta`` by transformers and
peft themselves, then each parameter and buffer is given a fake tensor of its shape and dtype that
keeps its ``requires_grad``: the frozen base, the trained adapters and head, tied weights still one.

    effitrain estimate adapter=lora           # trainable weights, and the step peak replayed
"""

from __future__ import annotations

import torch


def replay_model(auto, config, cfg, task):
    """``cfg``'s model of ``auto`` (a transformers auto class) from ``config``, with ``cfg.adapter``'s
    adapter as a run applies it (:func:`effitrain.train.adapters.apply_adapter`), made of fake
    tensors: call it under a fake tensor mode. Without an adapter the model is built directly there."""
    from effitrain.train.adapters import uses_adapter

    adapter_cfg = cfg.get("adapter")
    if not uses_adapter(adapter_cfg):
        with torch.device("cpu"):
            return auto.from_config(config)
    return faked(meta_model(auto, config, cfg, task))


def meta_model(auto, config, cfg, task):
    """``cfg``'s model with its adapter, on ``meta``: shapes and ``requires_grad``, nothing allocated."""
    from effitrain.train.adapters import apply_adapter

    with torch.device("meta"):  # peft's own layers too
        return apply_adapter(auto.from_config(config), cfg.get("adapter"), task)


def faked(model):
    """``model`` (on ``meta``) with a fake tensor in place of each parameter and buffer, of the same
    shape and dtype; a parameter keeps ``requires_grad``, one shared by two modules stays shared.
    Call it under a fake tensor mode: ``torch.empty`` there allocates nothing."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (meta, fake): the meta one kept alive

    def fake(tensor):
        if id(tensor) not in made:
            empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            is_parameter = isinstance(tensor, torch.nn.Parameter)
            made[id(tensor)] = (
                tensor,
                torch.nn.Parameter(empty, tensor.requires_grad) if is_parameter else empty,
            )
        return made[id(tensor)][1]

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, fake(param))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, fake(buffer))
    return model
