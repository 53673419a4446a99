"""The step peak: tensor memory by category at the highest point of one optimizer step, measured on a
real step of a run (:class:`StepMemory`). The prediction replays the same step on fake tensors
(:mod:`effitrain.memory.replay`) under the same tracker and reads it with the same :func:`breakdown`.

Both use PyTorch's dispatch-level ``MemTracker``, which attributes every live tensor to parameters,
buffers, gradients, activations, temporaries or optimizer state. It counts tensors, not processes,
so the figure is the same on CPU and CUDA and comparable across jobs even in one process. Tensors
that exist before the step and belong to none of the model or optimizer (the micro-batches the data
loader already made) are not counted, in the measurement and the prediction alike, until an
operation in the step views one (a causal LM shifts its labels, GPT-2 reshapes its inputs): its
storage then counts as an activation from that moment on, in both.
"""

from __future__ import annotations

import contextlib

import torch

from effitrain.config.summary_schema import CATEGORIES
from effitrain.util.compat import OFFLOADED_HOST, step_peak_tracker_class

# The host figure beside the categories: what activation offloading holds in host memory.
HOST_OFFLOADED = "host_offloaded"

# MemTracker's categories -> effitrain's (the summary's keys); buffers are model state like weights.
CATEGORY_OF = {
    "Parameter": "weights",
    "Buffer": "weights",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "temporaries",
}


def step_tracker():
    """A ``MemTracker`` that keeps only the whole step's peak. MemTracker also keeps every module's
    own peak, at the cost of a pass over all modules on each operator; nothing here reads those,
    and skipping them is what brings a tracked step near a plain one's time."""
    return step_peak_tracker_class()()


def breakdown(snapshot: dict) -> dict[str, int]:
    """Bytes per category of a MemTracker snapshot (all devices together), ``total``, and
    ``host_offloaded``: the host copies of offloaded activations (``activation_offloading``), at the
    host's own peak and outside the categories and the total, which are the device's."""
    totals = dict.fromkeys(CATEGORIES, 0)
    totals[HOST_OFFLOADED] = 0
    for device, per_device in snapshot.items():
        for kind, nbytes in per_device.items():
            kind = getattr(kind, "value", kind)
            if kind in CATEGORY_OF:
                totals[HOST_OFFLOADED if device is OFFLOADED_HOST else CATEGORY_OF[kind]] += int(nbytes)
    totals["total"] = sum(totals[c] for c in CATEGORIES)
    return totals


class StepMemory:
    """Measures one optimizer step of a run (``step``, 1-based) and remembers its micro-batches'
    shapes, so the prediction can replay exactly that step.

    ``job.track_step(step)`` enters :meth:`track`: a context around an optimizer step that tracks
    only the chosen one; :meth:`saw` is called before each micro-batch's forward. A backend that
    cannot wrap its step in a ``with`` (the Trainer) calls :meth:`begin` and :meth:`end` itself.
    """

    def __init__(self, model, optimizer, step: int, meter=None):
        self.model, self.optimizer, self.step, self.meter = model, optimizer, step, meter
        self.peak: dict[str, int] | None = None
        self.batches: list[dict] = []  # {key: (shape, dtype)} of each micro-batch of the tracked step
        self._tracker = None

    @contextlib.contextmanager
    def track(self, step: int):
        if step != self.step:
            yield
            return
        self.begin(step)
        try:
            yield
        finally:
            self.end()

    @property
    def active(self) -> bool:
        return self._tracker is not None

    def begin(self, step: int) -> None:
        if step != self.step or self.peak is not None:
            return
        tracker = step_tracker()
        tracker.track_external(self.model, self.optimizer)
        # torch.compile cannot run under the tracker's dispatch mode: the tracked step runs eagerly
        # (a compiled model falls back to eager there anyway; torchao's optimizers compile their
        # update with fullgraph=True, which would fail instead)
        with contextlib.ExitStack() as entered:  # both or neither: a failed enter leaves no stance behind
            entered.enter_context(torch.compiler.set_stance("force_eager"))
            entered.enter_context(tracker)
            self._entered = entered.pop_all()
        self._tracker = tracker
        if self.meter is not None:
            self.meter.leave_untimed()

    def saw(self, batch) -> None:
        """A micro-batch of the step starts (called before its forward)."""
        if not self.active:
            return
        if self.batches:  # the model runs again in this step: MemTracker wants fresh module stats
            self._tracker.reset_mod_stats()
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in batch.items() if torch.is_tensor(v)}
        mask = batch.get("attention_mask")
        # a model skips building its attention mask when nothing is padded: the replay must too
        shapes["padded"] = bool((mask == 0).any()) if mask is not None else False
        self.batches.append(shapes)

    def end(self) -> None:
        """Leave the tracker (also after a failed step, so no dispatch mode outlives the run)."""
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return
        self._entered.close()  # the tracker, then the stance (also when the tracker's exit raises)
        self.peak = breakdown(tracker.get_tracker_snapshot("peak"))
        tracker.reset_mod_stats()

    def summary(self) -> dict:
        if self.peak is None:
            return {}
        return {**peak_keys(self.peak), "mem/step_peak_tracked_step": self.step}


def peak_keys(peak: dict[str, int], suffix: str = "") -> dict:
    """``mem/step_peak_bytes<suffix>`` and ``mem/step_peak<suffix>/<category>_bytes``: the measured
    step peak (no suffix) or the predicted one (``_predicted``); and the host's
    ``mem/step_peak<suffix>/host_offloaded_bytes`` (0 without activation offloading)."""
    keys = {f"mem/step_peak_bytes{suffix}": peak["total"]}
    keys.update({f"mem/step_peak{suffix}/{c}_bytes": peak[c] for c in CATEGORIES})
    keys[f"mem/step_peak{suffix}/{HOST_OFFLOADED}_bytes"] = peak.get(HOST_OFFLOADED, 0)
    return keys
