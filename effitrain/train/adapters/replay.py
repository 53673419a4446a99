"""What the replay needs of an adapter (``adapter=lora``, ``dora``, ``qlora``): the step peak of an adapted
model is predicted by the same fake-tensor replay as a full fine-tuning's (:mod:`effitrain.memory.replay`).

peft cannot wrap a model made of fake tensors (moving an adapter to its base layer's device swaps
tensors, which fake ones refuse), so the model is built and wrapped on ``meta`` by transformers and
peft themselves (:func:`effitrain.train.adapters.build.model_on_meta`), then each parameter and buffer
is given a fake tensor of its shape and dtype that keeps its ``requires_grad``: the frozen base, the
trained adapters and head, tied weights still one. bitsandbytes' 4-bit layers need quantized values
fake tensors lack: a 4-bit base is replayed at full precision and its packed codes counted
(:func:`counted_4bit`).

    effitrain estimate adapter=lora           # trainable weights, and the step peak replayed
"""

from __future__ import annotations

import torch

from effitrain.train.adapters.build import model_on_meta
from effitrain.train.adapters.configs import keeping_head, quantization_config, uses_adapter
from effitrain.util.compat import keep_in_fp32_modules


def replay_model(auto, config, cfg, task):
    """``cfg``'s model of ``auto`` (a transformers auto class) from ``config``, with ``cfg.adapter``'s
    adapter as a run applies it, made of fake tensors: call it under a fake tensor mode. Without an
    adapter the model is built directly there."""
    if not uses_adapter(cfg.get("adapter")):
        with torch.device("cpu"):
            return auto.from_config(config)
    return faked(adapted_on_meta(auto, config, cfg, task))


def adapted_on_meta(auto, config, cfg, task):
    """``cfg``'s model with its adapter, on ``meta``, from ``config`` (``auto``: ``task``'s class):
    :func:`effitrain.train.adapters.build.model_on_meta`, as the replay calls it."""
    return model_on_meta(cfg, task, lambda: config)


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


BLOCKSIZE_4BIT = 64  # bitsandbytes' default 4-bit block: one absmax per 64 weights
BOUND_DEQUANTIZED = (
    "the 4-bit base (qlora) is counted, not replayed: its packed codes in place of the replayed "
    "full-precision weights, and its largest layer dequantized to the compute dtype (with its "
    "absmax) added to the temporaries throughout, as bitsandbytes' matmul holds it in forward and backward"
)


# On CUDA bitsandbytes' kernels keep other tensors than its CPU path: the same count is no bound there.
NOT_BOUND_ON_CUDA = (
    "the 4-bit base (qlora) is counted, not replayed, and on CUDA this is no bound: bitsandbytes' CUDA "
    "kernels keep other tensors than the count assumes (on an H200 this prediction was 3.9% above the "
    "measured step on one model and 2.7% below it on another)"
)


def counted_4bit(phases: dict[str, dict[str, int]], config, cfg, device: str = "cpu") -> str | None:
    """``adapter=qlora``'s base weights in 4-bit, in ``phases`` (the replay's peaks, traced with the
    base in full precision: bitsandbytes' 4-bit layers need quantized values fake tensors lack). The
    layers transformers' quantizer converts (its own choice, on ``meta``) hold ``ceil(n / 2)`` bytes
    of packed codes each where the replay held the full weight (the quantization state beside them
    is neither a parameter nor a buffer: the step tracker counts it nowhere); the largest one's
    dequantized copy and its fp32 absmax are added as a temporary. Returns the bound this makes of
    the figures (None without a quantized base)."""
    quantization = _quantization(cfg)
    if quantization is None:
        return None
    layers = quantized_layers(_auto(cfg), config, quantization)
    largest = max(layers, key=torch.Tensor.numel)
    # dequantized to the weight's own dtype, then cast to the compute dtype where that differs
    cast = largest.dtype != quantization.bnb_4bit_compute_dtype
    compute = torch.empty((), dtype=quantization.bnb_4bit_compute_dtype).element_size() if cast else 0
    absmax = 4 * -(-largest.numel() // BLOCKSIZE_4BIT)  # fp32, dequantized from double quantization's
    dequantized = largest.numel() * (largest.element_size() + compute) + absmax
    unpacked = unpacked_4bit_bytes(config, cfg)
    for peak in phases.values():
        peak["weights"] -= unpacked
        peak["temporaries"] += dequantized
        peak["total"] += dequantized - unpacked
    return NOT_BOUND_ON_CUDA if device == "cuda" else BOUND_DEQUANTIZED


def unpacked_4bit_bytes(config, cfg) -> int:
    """What a full-precision model of ``config`` holds beyond ``cfg``'s 4-bit one (``adapter=qlora``)
    in its weights: each layer the quantizer converts keeps ``ceil(n / 2)`` bytes of packed codes
    (its quantization state beside them is neither a parameter nor a buffer). 0 without a 4-bit base."""
    quantization = _quantization(cfg)
    if quantization is None:
        return 0
    layers = quantized_layers(_auto(cfg), config, quantization)
    return sum(weight.numel() * weight.element_size() - (weight.numel() + 1) // 2 for weight in layers)


def _quantization(cfg):
    return quantization_config(cfg.get("adapter"), cfg.precision.mixed_precision)


def _auto(cfg):
    import transformers

    from effitrain.config.model_spec import task_class

    return getattr(transformers, task_class(cfg).auto_class)  # a class attribute of the task


def quantized_layers(auto, config, quantization) -> list[torch.Tensor]:
    """The (meta) weights of the layers transformers' 4-bit quantizer replaces by bitsandbytes'
    ``Linear4bit``, chosen by the quantizer itself (its skipped modules: the head, tied weights)."""
    from transformers.integrations import replace_with_bnb_linear
    from transformers.quantizers.auto import AutoHfQuantizer

    with torch.device("meta"):
        model = auto.from_config(config)
    quantization = keeping_head(quantization, model)  # as the run's loading (modeling.build_model)
    quantizer = AutoHfQuantizer.from_config(quantization)
    skipped = quantizer.get_modules_to_not_convert(
        model, quantization.llm_int8_skip_modules, keep_in_fp32_modules(model)
    )
    original = {name: module.weight for name, module in model.named_modules() if hasattr(module, "weight")}
    model = replace_with_bnb_linear(model, modules_to_not_convert=skipped, quantization_config=quantization)
    return [original[name] for name, module in model.named_modules() if type(module).__name__ == "Linear4bit"]
