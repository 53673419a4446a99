"""What ``activation_offloading`` does to a model (its technique: :mod:`.offloading`; this module
imports torch and is imported only by :meth:`.offloading.ActivationOffloading.apply`).

The model's forward runs under ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd
saves for backward passes through :meth:`Offloader.pack`, which copies one of the device's (not a
parameter's or a buffer's, at least the minimum size) to host memory and hands autograd the copy
instead; the device's tensor is then freed as soon as nothing else holds it. In backward
:meth:`Offloader.unpack` copies it back, a fresh device tensor the node frees when it is done. The
copies are exact, so training is bit-identical to the lever off.

On CUDA the host copy is pinned and made on a side stream with ``non_blocking``, as torchtune's
``OffloadActivations`` and TRL's do: the compute stream goes on while the copy runs; the device
tensor is recorded on the side stream (the allocator reuses its block only after the copy) and
backward's copy back waits for the copy's event. Bringing tensors back ahead of their node
(torchtune's prefetch) is not done: each comes back on the compute stream when its node asks.

With gradient checkpointing a checkpointed block's own hooks take its saved tensors (nothing is
saved, all is recomputed); what torch's non-reentrant checkpoint saves of the block's inputs is
saved outside them, so the block inputs are what is offloaded.

On the CPU the host is the device: nothing is copied unless :func:`copies_forced` is active, which
the CUDA profile's replay (fake CPU tensors standing for the GPU's,
:func:`effitrain.memory.cuda.cuda_kernels`) and tests use. Each host copy is made inside
:func:`effitrain.util.compat.storages_offloaded`, so a step tracker counts it as the host's, apart
from the device's categories.
"""

from __future__ import annotations

import contextlib
import functools
from types import MethodType

import torch

from effitrain.util.compat import storages_offloaded

_forced: list[bool] = []  # non-empty: tensors on the host are copied too (copies_forced)


@contextlib.contextmanager
def copies_forced():
    """Inside it, the saved tensors of a CPU step are copied as a GPU step's are: the CUDA replay's
    fake CPU tensors stand for the device's, and a test shows the copies change no bit."""
    _forced.append(True)
    try:
        yield
    finally:
        _forced.pop()


def forced() -> bool:
    return bool(_forced)


class Offloader:
    """The pack and unpack hooks of one model: ``minimum`` bytes and more of the saved tensors that
    are neither its parameters (or views of them) nor its buffers."""

    def __init__(self, model: torch.nn.Module, minimum: int):
        self.model, self.minimum = model, minimum
        self._buffers: set[int] = set()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def hooks(self):
        """The hooks for one forward (its buffers read now: a run moves the model after apply)."""
        self._buffers = {id(buffer) for buffer in self.model.buffers()}
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def offloads(self, tensor: torch.Tensor) -> bool:
        if tensor.layout != torch.strided or (tensor.device.type == "cpu" and not _forced):
            return False
        base = tensor if tensor._base is None else tensor._base
        if isinstance(base, torch.nn.Parameter) or id(base) in self._buffers:
            return False
        return tensor.numel() * tensor.element_size() >= self.minimum

    def pack(self, tensor: torch.Tensor):
        if not self.offloads(tensor):
            return tensor
        if tensor.device.type != "cuda":  # forced: a CPU copy, in the same layout
            with storages_offloaded():
                host = torch.empty_like(tensor, device="cpu")
            return host.copy_(tensor), tensor.device, None
        stream = self._streams.get(tensor.device)
        if stream is None:
            stream = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is computed
        with storages_offloaded():
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # its block is reused only once the copy is done
            copied = stream.record_event()
        return host, tensor.device, copied

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, device, copied = packed
        if copied is not None:
            torch.cuda.current_stream(device).wait_event(copied)
        return torch.empty_like(host, device=device).copy_(host, non_blocking=copied is not None)


def offloaded_forward(model: torch.nn.Module, minimum: int) -> None:
    """``model.forward`` run under :class:`Offloader`'s hooks; set on the instance, so peft (whose
    tuner calls ``model.forward``) and accelerate (which wraps ``model.forward`` for autocast)
    keep it."""
    offloader = Offloader(model, minimum)
    forward = model.forward.__func__  # wrapped unbound: its signature (the Trainer reads it) unchanged

    @functools.wraps(forward)
    def offloading(self, *args, **kwargs):
        with offloader.hooks():
            return forward(self, *args, **kwargs)

    model.forward = MethodType(offloading, model)
