"""Memory tracked while training: the process's current and peak memory, every gradient as it is
accumulated, and :class:`TrainingMemory`, everything ``mem/*`` of a run around the measured region."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import torch
from typing_extensions import Self

from effitrain.memory.count import (
    Footprint,
    optimizer_params,
    optimizer_state_footprint,
    params_footprint,
    storage_key,
)
from effitrain.memory.optimizer_state import estimate_optimizer_state

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
    while they exist: in the first backward pass. Two gradients on one storage count once; with the
    optimizer's update in backward (``optimizer_in_backward``) each gradient is freed before the next
    is made, and a later one at the address of a freed one is another storage, counted too.
    """

    def __init__(self, params):
        self._grads: dict[int, torch.Tensor] = {}
        self._handles = []
        self._params = [p for p in params if p.requires_grad]
        self._by_id = {id(p): p for p in self._params}

    def _storage(self, param) -> tuple:
        """(storage key, bytes) of ``param``'s gradient; (None, 0) where it has none."""
        if param.grad is None:
            return None, 0
        # a sharded (DTensor) gradient: this rank holds its local shard
        return storage_key(param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad)

    def _hook(self, param) -> None:
        if id(param) not in self._grads and param.grad is not None:
            # Keep the storage's identity and size, not the gradient: holding it would change memory.
            key, nbytes = self._storage(param)
            earlier = [other for other, (seen, _, _) in self._grads.items() if seen == key]
            if earlier and all(self._storage(self._by_id[other])[0] != key for other in earlier):
                key = (*key, "after a freed gradient", id(param))  # the address reused, not shared
            grad = param.grad
            self._grads[id(param)] = (key, nbytes, nbytes // grad.element_size())
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
            # an adapter's weights and the head it trains; the frozen rest is params_bytes minus these
            "mem/params_trainable_bytes": params_footprint(self.model, trainable_only=True).bytes,
            "mem/grads_bytes": grads.bytes if grads else None,
            "mem/optimizer_state_bytes": state.bytes,
            "mem/optimizer_state_elements": state.elements,
            "mem/optimizer_state_python_values": state.python_values,
            "mem/optimizer_bytes_per_param": state.bytes / trainable if trainable else None,
            "mem/optimizer_state_bytes_estimated": self.estimated.bytes if self.estimated else None,
        }
        keys.update(self.peak.summary())
        return keys
