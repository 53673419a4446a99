"""Many optimizers' traces from one forward and backward: what :func:`effitrain.memory.replay.trace_run`
finds for each, phase by phase and category by category, at the cost of one model's replay.

    effitrain estimate model=distilbert_base_cased --device cuda   # every optimizer, one replay

The forward and backward of a step, its clipping and an evaluation do not depend on the optimizer:
they are replayed once, and each optimizer's own step is replayed on top of them, at the moment the
step reaches ``optimizer.step()``, on the very gradients the backward left. A phase's peak is then
composed as the tracker of a full trace finds it. ``MemTracker`` keeps the categories at the moment
the total first reaches its highest value (a later moment replaces it only when strictly higher),
so a phase's peak is either

- the forward and backward's peak, plus the optimizer state held throughout it (none before the
  first step, whose ``optimizer.step`` creates it; all of it in a later step and in evaluation), or
- the optimizer step's own peak, plus what the step found held when it began (weights, gradients,
  the state, and the last micro-batch's loss and the gradient norm the step still holds),

whichever total is higher, the first on a tie. The two parts' tensors are disjoint (the forward's
residue is not the optimizer's), so the sums are exact; ``tests/memory/test_shared.py`` holds every
optimizer of conf/optimizer to a full trace, to the byte.
"""

from __future__ import annotations

import contextlib

import torch

from effitrain.memory.replay import (
    BOUND_ASSUMED_BRANCH,
    BOUND_COUNTED_STATE,
    CATEGORIES,
    Trace,
    breakdown,
    counted_state,
    replayed,
    step_tracker,
)


def trace_runs(config, optimizer_cfgs: dict, cfg, batches: list[dict], device: str = "cpu",
               eval_shapes: dict | None = None) -> dict[str, Trace]:  # fmt: skip
    """:func:`effitrain.memory.replay.trace_run` for each of ``optimizer_cfgs`` (name -> optimizer
    node), sharing one replay of the model: a :class:`Trace` per name, equal to the full trace's."""
    analytic = {name: counted_state(config, node, cfg) for name, node in optimizer_cfgs.items()}
    traces = {name: Trace({}, 0) for name in optimizer_cfgs}
    with replayed(config, cfg, batches, device, eval_shapes) as replay:
        optimizers = {name: replay.optimizer(node) for name, node in optimizer_cfgs.items()}
        for phase in ("first_step", "later_step"):
            _shared_step(replay, optimizers, phase, traces)
        if replay.evaluation is not None:
            replay.tracked("eval", replay.evaluate)
            weights = _held(replay.model)
            for name, optimizer in optimizers.items():
                state = _minus(_held(replay.model, optimizer), weights)  # held throughout evaluation
                traces[name].phases["eval"] = _plus(replay.phases["eval"], state)
    for name, trace in traces.items():
        trace.flops = replay.flops
        for peak in trace.phases.values():
            peak["optimizer_state"] += analytic[name]
            peak["total"] += analytic[name]
        if analytic[name]:
            trace.bounds["first_step"] = BOUND_COUNTED_STATE
    return traces


def _shared_step(replay, optimizers: dict, phase: str, traces: dict) -> None:
    """One step's forward and backward under a tracker that knows only the model; where it reaches
    ``optimizer.step()``, each optimizer's step under a tracker of its own, on the same gradients."""
    with contextlib.ExitStack() as forward_backward:
        tracker = step_tracker()
        tracker.track_external(replay.model)
        forward_backward.enter_context(tracker)

        def step_each():
            before = breakdown(tracker.get_tracker_snapshot("peak"))
            at_step = breakdown(tracker.get_tracker_snapshot("current"))
            forward_backward.close()  # what follows is each optimizer's, not the shared part's
            gradients = [p.grad for p in replay.model.parameters()]
            held = _held(replay.model)  # weights and gradients
            for name, optimizer in optimizers.items():
                for param, grad in zip(replay.model.parameters(), gradients):
                    param.grad = grad  # as the backward left them, whatever an earlier step did
                own = step_tracker()
                own.track_external(replay.model, optimizer)
                entry = breakdown(own.get_tracker_snapshot("current"))
                state = _minus(entry, held)  # the optimizer state held before its step
                replay.assumed.clear()
                with own:
                    optimizer.step()
                stepped = _plus(
                    at_step, _plus(state, _minus(breakdown(own.get_tracker_snapshot("peak")), entry))
                )
                forward = _plus(before, state)
                traces[name].phases[phase] = stepped if stepped["total"] > forward["total"] else forward
                if torch.bool in replay.assumed:
                    traces[name].bounds[phase] = BOUND_ASSUMED_BRANCH

        pause = _Pause(replay.model, step_each)
        replay.step(pause, lambda batch: tracker.reset_mod_stats())


class _Pause:
    """Stands in for the optimizer in the shared forward and backward: its ``step`` is where every
    optimizer's own step is replayed; ``zero_grad`` frees the gradients as each optimizer's would."""

    def __init__(self, model, step):
        self.model, self.step = model, step

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.model.parameters():
            param.grad = None


def _held(model, *external) -> dict[str, int]:
    """Bytes by category a fresh tracker finds held by ``model`` (weights, gradients) and ``external``
    (an optimizer's state)."""
    tracker = step_tracker()
    tracker.track_external(model, *external)
    with tracker:  # its exit removes the gradient hooks track_external installs
        pass
    return breakdown(tracker.get_tracker_snapshot("current"))


def _plus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    total = {c: a[c] + b[c] for c in CATEGORIES}
    return {**total, "total": sum(total.values())}


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return _plus(a, {c: -b[c] for c in CATEGORIES})
