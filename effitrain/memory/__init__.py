"""Memory: exact accounting of what training holds (count.py), an analytic estimate from shapes
(estimate.py), and tracking while training (track.py).

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

from effitrain.memory.count import (
    MIB,
    Footprint,
    footprint,
    optimizer_params,
    optimizer_state_footprint,
    params_footprint,
)
from effitrain.memory.optimizer_state import estimate_optimizer_state, grads_estimate
from effitrain.memory.track import GradientRecorder, PeakMemory, TrainingMemory, current_bytes

__all__ = [
    "MIB",
    "Footprint",
    "GradientRecorder",
    "PeakMemory",
    "TrainingMemory",
    "current_bytes",
    "estimate_optimizer_state",
    "footprint",
    "grads_estimate",
    "optimizer_params",
    "optimizer_state_footprint",
    "params_footprint",
]
