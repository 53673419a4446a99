"""Memory estimated from shapes alone, before running: the optimizer's state as each optimizer
allocates it in its first step (works on a ``meta`` model). A configuration's whole footprint with
its step peak is :func:`effitrain.commands.estimate.estimate_memory`.

The formulas live here, one per optimizer family; each family's row
(:data:`effitrain.config.optimizers.OPTIMIZER_FAMILIES`) names its formula and the class it
describes, so that the config layer knows the families without importing torch."""

from __future__ import annotations

import contextvars
import importlib

import torch

from effitrain.config.optimizers import state_family
from effitrain.memory.count import Footprint, footprint, optimizer_params
from effitrain.memory.cuda import in_blocks
from effitrain.util.compat import torchao_moments_owner

# bitsandbytes 0.50.2, Optimizer2State.init_state: 8-bit moments are quantized in blocks of 256
# elements, each block with one fp32 absmax scale per moment. Not exposed as an attribute.
BNB_BLOCKSIZE = 256


# The allocation unit each state tensor is rounded up to (1: bytes; CUDA's allocator: 512).
_BLOCK = contextvars.ContextVar("block", default=1)


def _tensor(numel: int, dtype: torch.dtype) -> Footprint:
    return Footprint(bytes=in_blocks(numel * dtype.itemsize, _BLOCK.get()), elements=numel, storages=1)


def _local_numel(param) -> int:
    """The elements of the state made like ``param``: a sharded (DTensor) parameter's state is made
    like this rank's shard, its unpadded rows."""
    return param.to_local().numel() if hasattr(param, "to_local") else param.numel()


def adam_state(optimizer) -> Footprint:
    """torch Adam/AdamW: exp_avg and exp_avg_sq like the parameter, one scalar step tensor each."""
    from effitrain.util.compat import adam_step_dtype

    total = Footprint()
    for group in optimizer.param_groups:
        moments = 3 if group.get("amsgrad") else 2
        fused_or_capturable = group.get("fused") or group.get("capturable")
        step_dtype = adam_step_dtype(group.get("fused")) if fused_or_capturable else adam_step_dtype()
        for param in group["params"]:
            for _ in range(moments):
                total += _tensor(_local_numel(param), param.dtype)
            total += _tensor(1, step_dtype)
    return total


def _init_state_unchanged(cls) -> bool:
    """Subclasses that override init_state (AdEMAMix: three moments) allocate something else."""
    return any(
        f"{c.__module__}.{c.__qualname__}" == "bitsandbytes.optim.optimizer.Optimizer2State"
        and cls.init_state is c.init_state
        for c in cls.__mro__
    )


def bnb_two_state(optimizer) -> Footprint | None:
    """bitsandbytes Optimizer2State (Adam8bit, AdamW8bit, ...): see its ``init_state``.

    Tensors with fewer than ``min_8bit_size`` elements (or all, with ``optim_bits=32``) keep two
    fp32 moments. Larger ones keep two uint8 moments, one fp32 absmax per block of 256 elements
    per moment, and share the two 256-entry quantization maps (one pair per device); ``step`` is
    a Python int. A subclass with its own ``init_state`` is not covered (None).
    """
    if not _init_state_unchanged(type(optimizer)):
        return None
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


def adafactor_state(optimizer) -> Footprint:
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


def lion_state(optimizer) -> Footprint:
    """lion_pytorch's Lion: one moment (``exp_avg``) like each parameter, nothing else."""
    total = Footprint()
    for group in optimizer.param_groups:
        for param in group["params"]:
            total += _tensor(_local_numel(param), param.dtype)
    return total


def apollo_state(optimizer) -> Footprint | None:
    """apollo_torch's APOLLO AdamW (random projections; the SVD projector is not covered: None).

    Every parameter holds two Python ints (``seed``, set when the optimizer is built, and
    ``step``). A parameter of a group without ``rank`` keeps AdamW's two moments like itself. One
    of a group with ``rank`` (an m x n matrix) keeps: its projector (a Python object) holding the
    random matrix, rank x n for a right projection or m x rank for a left one (``proj_type`` std:
    right when m >= n); the two moments of the projected gradient (m x rank or rank x n); and,
    unless ``disable_nl``, the norm of the last scaled gradient (a 0-d tensor), all in the
    parameter's dtype.
    """
    total = Footprint()
    for group in optimizer.param_groups:
        for param in group["params"]:
            total += Footprint(python_values=2)  # seed, step
            if "rank" not in group:
                total += _tensor(param.numel(), param.dtype) + _tensor(param.numel(), param.dtype)
                continue
            if group["proj"] != "random":
                return None
            rows, cols = param.shape
            right = {"std": rows >= cols, "reverse_std": rows < cols, "right": True, "left": False}
            if group["proj_type"] not in right:
                return None
            side = cols if right[group["proj_type"]] else rows
            other = rows if right[group["proj_type"]] else cols
            total += Footprint(python_values=1) + _tensor(group["rank"] * side, param.dtype)  # projector
            total += _tensor(group["rank"] * other, param.dtype) + _tensor(group["rank"] * other, param.dtype)
            if not optimizer.disable_nl:
                total += _tensor(1, param.dtype)
    return total


# torchao 0.18, torchao/optim/subclass_{4bit,8bit}.py, by the optimizer class's suffix (AdamW4bit,
# Adam8bit, ...): bits per element, and entries of the quantization map each quantized tensor holds
# (its own copy; the map is not shared).
TORCHAO_QUANTIZED = {"4bit": (4, 16), "8bit": (8, 256)}


def torchao_adam_state(optimizer) -> Footprint | None:
    """torchao's low-bit Adam/AdamW (``torchao.optim``), see ``_AdamBase._new_buffer``.

    Per parameter a 0-d fp32 ``step`` and two moments (three with ``amsgrad``). A tensor of at
    least 4096 elements, a multiple of ``block_size``, gets quantized moments: packed codes (uint8),
    one fp32 scale per block and its own fp32 quantization map; a smaller one, moments like itself.
    FP8 state and DTensor parameters are not covered (None).
    """
    # the class that chooses the moments' subclass (a user's subclass of AdamW4bit inherits it)
    owner = torchao_moments_owner(optimizer)
    if owner is None or owner.__name__[-4:] not in TORCHAO_QUANTIZED:
        return None
    bits, map_entries = TORCHAO_QUANTIZED[owner.__name__[-4:]]
    block = optimizer.block_size
    total = Footprint()
    for group in optimizer.param_groups:
        moments = 3 if group.get("amsgrad") else 2
        for param in group["params"]:
            numel = param.numel()
            total += _tensor(1, torch.float32)  # step
            for _ in range(moments):
                if numel >= 4096 and numel % block == 0:
                    total += _tensor(numel * bits // 8, torch.uint8) + _tensor(numel // block, torch.float32)
                    total += _tensor(map_entries, torch.float32)
                else:
                    total += _tensor(numel, param.dtype)
    return total


def estimate_optimizer_state(optimizer, block: int = 1) -> Footprint | None:
    """The state ``optimizer`` will hold after its first step, from its parameters' shapes alone;
    each tensor rounded up to whole ``block``s of bytes (CUDA's allocator: 512).

    The optimizer may be built on ``meta`` parameters: construction allocates no state. Only the
    parameters that get a gradient get state; all of the optimizer's parameters are assumed to.
    Returns None for an optimizer with no known formula. Which formula describes it is its family's
    (:func:`effitrain.config.optimizers.state_family`, by the classes of its MRO).
    """
    family = state_family(type(optimizer))
    if family is None:
        return None
    module, _, name = family.state_formula.rpartition(".")
    formula = getattr(importlib.import_module(module), name)
    token = _BLOCK.set(block)
    try:
        return formula(optimizer)
    finally:
        _BLOCK.reset(token)


def grads_estimate(optimizer) -> Footprint:
    """One gradient like each parameter the optimizer updates (shared storages once, as for weights)."""
    return footprint(optimizer_params(optimizer))
