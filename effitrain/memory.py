"""Memory: exact accounting of what training holds, an analytic estimate from shapes, and peak tracking.

Three things, each measured the same way in every run and by ``effitrain estimate``:

* :func:`footprint` counts the bytes of the *distinct storages* behind a set of tensors: a tied or
  shared weight, or the quantization map bitsandbytes hands to every parameter's state, is counted
  once; a tensor subclass (torchao, DTensor, ...) is counted by the plain tensors it is made of, not by
  ``element_size()``. Python numbers in optimizer state (the ``step`` of Adafactor and 8-bit Adam)
  hold no tensor memory: they are left out of the bytes and reported apart, as a count.
* :func:`estimate_optimizer_state` predicts the optimizer's state from parameter shapes alone (it
  works on a ``meta`` model), following what each optimizer allocates in its first step.
* :class:`TrainingMemory` wraps the measured region (the backend's loop): it resets the peak on
  entry (CUDA allocator stats, or the process's RSS high-water mark on CPU), sees every gradient
  through a hook, and on exit reads the peak and the optimizer's state.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from typing_extensions import Self

MIB = 2**20

# bitsandbytes 0.50.2, Optimizer2State.init_state: 8-bit moments are quantized in blocks of 256
# elements, each block with one fp32 absmax scale per moment. Not exposed as an attribute.
BNB_BLOCKSIZE = 256


@dataclass(frozen=True)
class Footprint:
    """Memory held by a set of tensors, each distinct storage counted once."""

    bytes: int = 0
    elements: int = 0
    storages: int = 0
    python_values: int = 0  # non-tensor leaves (ints, floats): no tensor memory

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int]:
        return (self.bytes, self.elements, self.storages, self.python_values)

    @classmethod
    def of(cls, storages: dict, python_values: int = 0) -> Footprint:
        """From ``{storage key: (bytes, elements)}``, one entry per distinct storage."""
        return cls(
            bytes=sum(b for b, _ in storages.values()),
            elements=sum(e for _, e in storages.values()),
            storages=len(storages),
            python_values=python_values,
        )


def _leaves(value):
    """Plain tensors and non-tensor leaves inside nested dicts/lists/tuples and tensor subclasses."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            # A wrapper subclass owns no storage: what it stores are its inner tensors.
            attributes, _ = value.__tensor_flatten__()
            for name in attributes:
                yield from _leaves(getattr(value, name))
        else:
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            yield from _leaves(item)
    elif value is not None:
        yield value


def _storage_key(tensor: torch.Tensor):
    storage = tensor.untyped_storage()
    if storage.data_ptr() == 0:
        # No real memory (meta tensors, empty storages): tell tensors apart by identity.
        return (tensor.device, "id", id(tensor)), storage.nbytes()
    return (tensor.device, storage.data_ptr()), storage.nbytes()


def footprint(*values) -> Footprint:
    """Bytes and elements of the distinct storages behind every tensor in ``values`` (nested freely).

    A storage's elements are its bytes over the item size of the first tensor seen on it, so a view
    of part of a buffer counts the whole buffer, which is what stays allocated.
    """
    seen: dict = {}
    python_values = 0
    for leaf in _leaves(values):
        if not isinstance(leaf, torch.Tensor):
            python_values += 1
            continue
        key, nbytes = _storage_key(leaf)
        if key not in seen:
            seen[key] = (nbytes, nbytes // leaf.element_size())
    return Footprint.of(seen, python_values)


def optimizer_state_footprint(optimizer) -> Footprint:
    """What ``optimizer.state`` holds now (quantization maps and absmax buffers included)."""
    return footprint(list(optimizer.state.values()))


def optimizer_params(optimizer) -> list[torch.Tensor]:
    """The distinct parameters an optimizer updates, in group order."""
    params, seen = [], set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


# --- the analytic estimate ---------------------------------------------------------------------


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


def params_footprint(model: torch.nn.Module) -> Footprint:
    return footprint(list(model.parameters()))


def grads_estimate(optimizer) -> Footprint:
    """One gradient like each parameter the optimizer updates (shared storages once, as for weights)."""
    return footprint(optimizer_params(optimizer))


# --- current and peak process memory ----------------------------------------------------------

_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def current_bytes(device) -> int | None:
    """Memory in use now: CUDA tensors allocated on ``device``, else the process's resident set."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_bytes("VmRSS")


class PeakMemory:
    """Peak memory of the region inside ``with``.

    CUDA: the allocator's peak allocated/reserved bytes after ``reset_peak_memory_stats``. CPU: the
    process's resident-set high-water mark (``VmHWM``) after resetting it through
    ``/proc/self/clear_refs``; where that file cannot be written, a thread samples ``VmRSS`` every
    ``sample_s`` (a sampled peak can miss a short spike). Earlier jobs of the same process do not
    leak into the figure, but memory still held from them counts (a resident set is the process's).
    """

    def __init__(self, device, sample_s: float = 0.01):
        self.device = torch.device(device)
        self.sample_s = sample_s
        self.peak_bytes: int | None = None
        self.peak_reserved_bytes: int | None = None
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampled_peak = 0
        self._read_peak = 0

    def read_current(self) -> int | None:
        """``current_bytes`` now, also counted into the peak: a resident set read inside the region
        never exceeds the peak reported for it (some kernels leave ``VmHWM`` behind ``VmRSS`` after
        memory is returned and taken again)."""
        now = current_bytes(self.device)
        self._read_peak = max(self._read_peak, now or 0)
        return now

    def __enter__(self) -> Self:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self._sampled_peak = _status_bytes("VmRSS") or 0
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.sample_s):
            self._sampled_peak = max(self._sampled_peak, _status_bytes("VmRSS") or 0)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        elif self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self.peak_bytes = max(self._sampled_peak, self._read_peak, _status_bytes("VmRSS") or 0) or None
        else:
            self.peak_bytes = max(_status_bytes("VmHWM") or 0, self._read_peak) or None

    def summary(self) -> dict:
        """Named for what they are: a process's resident set (libraries included) on CPU, the
        allocator's peaks on CUDA. Context only; comparisons rank by the step peak."""
        if self.device.type == "cuda":
            return {
                "mem/cuda_max_allocated_bytes": self.peak_bytes,
                "mem/cuda_max_reserved_bytes": self.peak_reserved_bytes,
            }
        return {"mem/process_peak_rss_bytes": self.peak_bytes}


class GradientRecorder:
    """Sees each parameter's gradient once, right after it is accumulated, and keeps its storage.

    Gradients are freed by ``zero_grad(set_to_none=True)`` before a run ends, so they are counted
    while they exist: in the first backward pass, when all of them are alive at once.
    """

    def __init__(self, params):
        self._grads: dict[int, torch.Tensor] = {}
        self._handles = []
        self._params = [p for p in params if p.requires_grad]

    def _hook(self, param) -> None:
        if id(param) not in self._grads and param.grad is not None:
            # Keep the storage's identity and size, not the gradient: holding it would change memory.
            key, nbytes = _storage_key(param.grad)
            self._grads[id(param)] = (key, nbytes, nbytes // param.grad.element_size())
            if len(self._grads) == len(self._params):  # all seen: no hook in later backward passes
                self.__exit__()

    def __enter__(self) -> Self:
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self._params]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def footprint(self) -> Footprint | None:
        if not self._grads:
            return None
        return Footprint.of({key: (nbytes, elements) for key, nbytes, elements in self._grads.values()})


class TrainingMemory:
    """Everything ``mem/*`` of a run: wrap the backend's loop in ``with TrainingMemory(...)``."""

    def __init__(self, model: torch.nn.Module, optimizer, device):
        self.model = model
        self.optimizer = optimizer
        self.peak = PeakMemory(device)
        self.grads = GradientRecorder(optimizer_params(optimizer))
        self.estimated = estimate_optimizer_state(optimizer)

    def __enter__(self) -> Self:
        self.grads.__enter__()
        self.peak.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.peak.__exit__(*exc)
        self.grads.__exit__(*exc)

    def summary(self) -> dict:
        state = optimizer_state_footprint(self.optimizer)
        trainable = sum(p.numel() for p in optimizer_params(self.optimizer))
        grads = self.grads.footprint()
        keys = {
            "mem/params_bytes": params_footprint(self.model).bytes,
            "mem/grads_bytes": grads.bytes if grads else None,
            "mem/optimizer_state_bytes": state.bytes,
            "mem/optimizer_state_elements": state.elements,
            "mem/optimizer_state_python_values": state.python_values,
            "mem/optimizer_bytes_per_param": state.bytes / trainable if trainable else None,
            "mem/optimizer_state_bytes_estimated": self.estimated.bytes if self.estimated else None,
        }
        keys.update(self.peak.summary())
        return keys


# --- before running: the whole static footprint of a configuration ---------------------------


def estimate_memory(cfg, optimizers: dict | None = None, step: bool = True) -> dict:
    """Memory of ``cfg``'s run before running it, in bytes, one row per optimizer.

    The static part (weights, gradients, optimizer state) comes from a ``meta`` model: nothing is
    allocated. ``step``: also the step peak by category, from one training step traced on fake
    tensors at the worst case (every micro-batch ``max_length`` tokens), with FLOPs. No tokenizer
    and no weights are read: the model's own architecture config (its vocabulary included) decides.

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
        if step and not cfg.get("gradient_checkpointing"):  # not replayed faithfully on fake tensors yet
            peak, flops = trace_step(
                model.config, optimizer_cfg, cfg, [batch] * cfg.gradient_accumulation_steps, True
            )
            rows[name]["step_peak_bytes"] = peak["total"]
            rows[name]["step_peak"] = {f"{c}_bytes": peak[c] for c in CATEGORIES}
            rows[name]["flops_per_step"] = flops
    return rows
