"""Memory estimated from shapes alone, before running: the optimizer's state as each optimizer
allocates it in its first step (works on a ``meta`` model), and a configuration's whole footprint
with its step peak (:func:`estimate_memory`)."""

from __future__ import annotations

import torch

from effitrain.memory.count import Footprint, footprint, optimizer_params, params_footprint

# bitsandbytes 0.50.2, Optimizer2State.init_state: 8-bit moments are quantized in blocks of 256
# elements, each block with one fp32 absmax scale per moment. Not exposed as an attribute.
BNB_BLOCKSIZE = 256


def _tensor(numel: int, dtype: torch.dtype) -> Footprint:
    return Footprint(bytes=numel * dtype.itemsize, elements=numel, storages=1)


def _adam_state(optimizer) -> Footprint:
    """torch Adam/AdamW: exp_avg and exp_avg_sq like the parameter, one scalar step tensor each."""
    from torch.optim.optimizer import _get_scalar_dtype

    total = Footprint()
    for group in optimizer.param_groups:
        moments = 3 if group.get("amsgrad") else 2
        fused_or_capturable = group.get("fused") or group.get("capturable")
        step_dtype = (
            _get_scalar_dtype(is_fused=group.get("fused")) if fused_or_capturable else _get_scalar_dtype()
        )
        for param in group["params"]:
            for _ in range(moments):
                total += _tensor(param.numel(), param.dtype)
            total += _tensor(1, step_dtype)
    return total


def _bnb_two_state(optimizer) -> Footprint:
    """bitsandbytes Optimizer2State (Adam8bit, AdamW8bit, ...): see its ``init_state``.

    Tensors with fewer than ``min_8bit_size`` elements (or all, with ``optim_bits=32``) keep two
    fp32 moments. Larger ones keep two uint8 moments, one fp32 absmax per block of 256 elements
    per moment, and share the two 256-entry quantization maps (one pair per device); ``step`` is
    a Python int.
    """
    total, devices = Footprint(), set()
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, param in enumerate(group["params"]):
            config = optimizer.get_config(gindex, pindex, group)
            eight_bit = config["optim_bits"] == 8 and param.numel() >= config["min_8bit_size"]
            if eight_bit:
                blocks = -(-param.numel() // BNB_BLOCKSIZE)
                total += _tensor(param.numel(), torch.uint8) + _tensor(param.numel(), torch.uint8)
                total += _tensor(blocks, torch.float32) + _tensor(blocks, torch.float32)
                devices.add(param.device)
            else:
                total += _tensor(param.numel(), torch.float32) + _tensor(param.numel(), torch.float32)
            if config["max_unorm"] > 0.0:
                total += _tensor(1, torch.float32)
            total += Footprint(python_values=1)  # step
    for _ in devices:
        for qmap in (optimizer.name2qmap["dynamic"], optimizer.name2qmap["udynamic"]):
            total += _tensor(qmap.numel(), qmap.dtype)
    return total


def _adafactor_state(optimizer) -> Footprint:
    """transformers Adafactor: factored row/column second moments for >=2-D tensors, full ones
    for 1-D, a full first moment only when ``beta1`` is set; fp32 for half-precision parameters
    (the gradient is upcast first). ``step`` is a Python int; ``RMS`` starts as the int 0 but each
    step replaces it with a 0-d tensor (the weights' RMS), so after a step it is tensor memory."""
    total = Footprint()
    for group in optimizer.param_groups:
        for param in group["params"]:
            dtype = torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype
            shape = param.shape
            if group["beta1"] is not None:
                total += _tensor(param.numel(), dtype)
            if len(shape) >= 2:
                total += _tensor(shape[:-1].numel(), dtype) + _tensor(
                    (shape[:-2] + shape[-1:]).numel(), dtype
                )
            else:
                total += _tensor(param.numel(), dtype)
            total += _tensor(1, dtype) + Footprint(python_values=1)  # RMS, step
    return total


def _bnb_two_state_unchanged(cls) -> bool:
    # Subclasses that override init_state (AdEMAMix: three moments) allocate something else.
    return any(
        f"{c.__module__}.{c.__qualname__}" == "bitsandbytes.optim.optimizer.Optimizer2State"
        and cls.init_state is c.init_state
        for c in cls.__mro__
    )


# Which formula describes an optimizer, by the classes in its MRO (qualified names, so checking
# never imports bitsandbytes or transformers for an optimizer that is neither).
ESTIMATORS = [
    ("torch.optim.adam.Adam", _adam_state),
    ("bitsandbytes.optim.optimizer.Optimizer2State", _bnb_two_state),
    ("transformers.optimization.Adafactor", _adafactor_state),
]


def estimate_optimizer_state(optimizer) -> Footprint | None:
    """The state ``optimizer`` will hold after its first step, from its parameters' shapes alone.

    The optimizer may be built on ``meta`` parameters: construction allocates no state. Only the
    parameters that get a gradient get state; all of the optimizer's parameters are assumed to.
    Returns None for an optimizer with no known formula.
    """
    cls = type(optimizer)
    names = {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}
    for name, estimator in ESTIMATORS:
        if name in names:
            if estimator is _bnb_two_state and not _bnb_two_state_unchanged(cls):
                return None
            return estimator(optimizer)
    return None


def grads_estimate(optimizer) -> Footprint:
    """One gradient like each parameter the optimizer updates (shared storages once, as for weights)."""
    return footprint(optimizer_params(optimizer))


def estimate_memory(cfg, optimizers: dict | None = None, step: bool = True) -> dict:
    """Memory of ``cfg``'s run before running it, in bytes, one row per optimizer.

    The static part (weights, gradients, optimizer state) comes from a ``meta`` model: nothing is
    allocated. ``step``: also the step peak by category, from one training step traced on fake
    tensors at the worst case (every micro-batch ``max_length`` tokens), with FLOPs. No weights
    are read: the model's architecture config decides, its vocabulary sized to the
    tokenizer for init=random as in a run (effitrain.modeling.build_model).

    ``optimizers`` maps names to optimizer config nodes (default: ``{"chosen": cfg.optimizer}``).
    """
    from effitrain.modeling import build_model
    from effitrain.optim import build_optimizer
    from effitrain.step_memory import CATEGORIES, trace_step
    from effitrain.tasks import build_task

    task = build_task(cfg)
    if task.uses_labels:
        num_labels = cfg.data.get("num_labels") or len(task.load(cfg.data).label_names)
    else:
        num_labels = None
    model = build_model(cfg.model, num_labels, None, device="meta", auto_class=task.auto_class)
    weights = params_footprint(model)
    tokens = (cfg.micro_batch_size, cfg.max_length)
    batch = {
        "input_ids": (tokens, torch.int64),
        "attention_mask": (tokens, torch.int64),
        "labels": (task.labels_shape(*tokens), torch.int64),
    }
    if getattr(model.config, "type_vocab_size", 0):  # BERT-like tokenizers return segment ids too
        batch["token_type_ids"] = ((cfg.micro_batch_size, cfg.max_length), torch.int64)
    rows = {}
    for name, optimizer_cfg in (optimizers or {"chosen": cfg.optimizer}).items():
        optimizer = build_optimizer(optimizer_cfg, model, cfg.weight_decay)
        grads, state = grads_estimate(optimizer), estimate_optimizer_state(optimizer)
        trainable = sum(p.numel() for p in optimizer_params(optimizer))
        rows[name] = {
            "params": sum(p.numel() for p in model.parameters()),
            "params_trainable": trainable,
            "vocab_size": getattr(model.config, "vocab_size", None),
            "weights_bytes": weights.bytes,
            "grads_bytes": grads.bytes,
            "optimizer_state_bytes": state.bytes if state else None,
            "optimizer_state_elements": state.elements if state else None,
            "optimizer_bytes_per_param": state.bytes / trainable if state and trainable else None,
            "total_bytes": weights.bytes + grads.bytes + state.bytes if state else None,
        }
        if step:
            peak, flops = trace_step(
                model.config, optimizer_cfg, cfg, [batch] * cfg.gradient_accumulation_steps, True
            )
            rows[name]["step_peak_bytes"] = peak["total"]
            rows[name]["step_peak"] = {f"{c}_bytes": peak[c] for c in CATEGORIES}
            rows[name]["flops_per_step"] = flops
    return rows
