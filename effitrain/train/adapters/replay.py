"""What the replay needs of an adapter (``adapter=lora``, ``dora``, ``qlora``): the step peak of an adapted
model is predicted by the same fake-tensor replay as a full fine-tuning's (:mod:`effitrain.memory.replay`).

peft cannot wrap a model made of fake tensors (moving an adapter to its base layer's device swaps
tensors, which fake ones refuse), so the model is built and wrapped on ``meta`` by transformers and
peft themselves (:func:`effitrain.train.adapters.build.model_on_meta`), then each parameter and buffer
is given a fake tensor of its shape and dtype that keeps its ``requires_grad``: the frozen base, the
trained adapters and head, tied weights still one. bitsandbytes' 4-bit layers need quantized values
fake tensors lack: a 4-bit base is replayed with its full-precision weights, each layer's forward
following bitsandbytes' ``Linear4bit.forward`` (:func:`as_4bit_layers`: the input cast to the compute
dtype, a matmul that saves nothing for backward but the weight, the output cast back to the input's
dtype: under bf16 the layers' outputs stay fp32, and so does what the next ops save), and its packed
codes counted (:func:`counted_4bit`).

    effitrain estimate adapter=lora           # trainable weights, and the step peak replayed
"""

from __future__ import annotations

import torch

from effitrain.train.adapters.build import model_on_meta
from effitrain.train.adapters.configs import keeping_head, quantization_config, uses_adapter
from effitrain.util.compat import keep_in_fp32_modules, outside_fake_mode


def replay_model(auto, config, cfg, task):
    """``cfg``'s model of ``auto`` (a transformers auto class) from ``config``, with ``cfg.adapter``'s
    adapter as a run applies it, made of fake tensors: call it under a fake tensor mode. Without an
    adapter the model is built directly there."""
    if not uses_adapter(cfg.get("adapter")):
        with torch.device("cpu"):
            return auto.from_config(config)
    model = faked(adapted_on_meta(auto, config, cfg, task))
    quantization = _quantization(cfg)
    if quantization is not None:
        with outside_fake_mode():  # the quantizer's own choice, made on meta
            names = quantized_names(auto, config, quantization)
        as_4bit_layers(model, names, quantization.bnb_4bit_compute_dtype)
    return model


class _Matmul4bit(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` on a full-precision stand-in of the weight: the weight
    dequantized to the input's dtype for the product (a temporary, as bitsandbytes' dequantizing
    matmul holds), only the weight kept for backward (bitsandbytes keeps its packed codes, a
    parameter), the input's gradient through the weight dequantized again."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight = weight
        return torch.nn.functional.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.weight.to(grad.dtype), None


def as_4bit_layers(model, names: set[str], compute_dtype) -> None:
    """Each ``torch.nn.Linear`` of ``model`` (peft-wrapped: its ``base_layer``) that transformers'
    quantizer makes a ``Linear4bit`` (``names``, as :func:`quantized_names` gives them) forwards as
    ``Linear4bit.forward`` does: ``x.to(compute_dtype)``, the matmul, ``.to(`` the input's dtype
    ``)``; peft's 4-bit LoRA layer clones that output (``result.clone()``), a LoRA-wrapped one here too."""
    import types

    def forward(layer, x, clone):
        dtype = x.dtype
        out = _Matmul4bit.apply(x.to(compute_dtype), layer.weight).to(dtype)
        return out.clone() if clone else out

    for name, module in model.named_modules():
        wrapped = name.endswith(".base_layer")
        plain = name.removesuffix(".base_layer").removeprefix("base_model.model.")
        if type(module) is torch.nn.Linear and plain in names:
            module.forward = types.MethodType(
                lambda layer, x, clone=wrapped: forward(layer, x, clone), module
            )


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
    "the 4-bit base (qlora) is replayed with its weights at full precision and counted: its packed "
    "codes in place of them, and its largest layer dequantized to the compute dtype (with its "
    "absmax) added to the temporaries throughout, as bitsandbytes' matmul holds it in forward and backward"
)


def counted_4bit(phases: dict[str, dict[str, int]], config, cfg, stored=lambda nbytes: nbytes) -> str | None:
    """``adapter=qlora``'s base weights in 4-bit, in ``phases`` (the replay's peaks, traced with the
    base in full precision: bitsandbytes' 4-bit layers need quantized values fake tensors lack). The
    layers transformers' quantizer converts (its own choice, on ``meta``) hold ``ceil(n / 2)`` bytes
    of packed codes each where the replay held the full weight (the quantization state beside them
    is neither a parameter nor a buffer: the step tracker counts it nowhere), and their biases in the
    compute dtype (``Linear4bit.forward`` casts its bias in place at the first call: ``bias.data =
    bias.data.to(x.dtype)``); the largest one's dequantized copy and its fp32 absmax are added as a
    temporary. ``stored``: the bytes a storage of that many bytes takes on the device (CUDA's
    allocation blocks). Returns the bound this makes of the figures (None without a quantized base)."""
    quantization = _quantization(cfg)
    if quantization is None:
        return None
    layers = _quantized(_auto(cfg), config, quantization).values()
    largest = max((layer.weight for layer in layers), key=torch.Tensor.numel)
    compute_dtype = quantization.bnb_4bit_compute_dtype
    # dequantized to the weight's own dtype, then cast to the compute dtype where that differs
    cast = largest.dtype != compute_dtype
    compute = torch.empty((), dtype=compute_dtype).element_size()
    absmax = 4 * -(-largest.numel() // BLOCKSIZE_4BIT)  # fp32, dequantized from double quantization's
    dequantized = largest.numel() * (largest.element_size() + (compute if cast else 0)) + absmax
    biases = [layer.bias for layer in layers if layer.bias is not None and layer.bias.dtype != compute_dtype]
    recast = sum(
        stored(bias.numel() * bias.element_size()) - stored(bias.numel() * compute) for bias in biases
    )
    unpacked = unpacked_4bit_bytes(config, cfg) + recast
    for peak in phases.values():
        peak["weights"] -= unpacked
        peak["temporaries"] += dequantized
        peak["total"] += dequantized - unpacked
    return BOUND_DEQUANTIZED


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


def quantized_names(auto, config, quantization) -> set[str]:
    """The names (in the unwrapped model) of the layers :func:`quantized_layers` finds."""
    return set(_quantized(auto, config, quantization))


def quantized_layers(auto, config, quantization) -> list[torch.Tensor]:
    """The (meta) weights of the layers transformers' 4-bit quantizer replaces by bitsandbytes'
    ``Linear4bit``, chosen by the quantizer itself (its skipped modules: the head, tied weights)."""
    return [layer.weight for layer in _quantized(auto, config, quantization).values()]


def _quantized(auto, config, quantization) -> dict[str, torch.nn.Linear]:
    """The (meta) ``Linear`` layers the quantizer converts, by name, as they were before it."""
    from transformers.integrations import replace_with_bnb_linear
    from transformers.quantizers.auto import AutoHfQuantizer

    with torch.device("meta"):
        model = auto.from_config(config)
    quantization = keeping_head(quantization, model)  # as the run's loading (modeling.build_model)
    quantizer = AutoHfQuantizer.from_config(quantization)
    skipped = quantizer.get_modules_to_not_convert(
        model, quantization.llm_int8_skip_modules, keep_in_fp32_modules(model)
    )
    original = dict(model.named_modules())
    model = replace_with_bnb_linear(model, modules_to_not_convert=skipped, quantization_config=quantization)
    return {
        name: original[name]
        for name, module in model.named_modules()
        if type(module).__name__ == "Linear4bit"
    }
