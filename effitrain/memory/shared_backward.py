"""The forward and backward a step's optimizers share (:mod:`effitrain.memory.shared_traces`): replayed
on the whole model to where the step reaches ``optimizer.step()`` (:func:`forward_backward`), or, for
a model of many alike blocks, found from replays of fewer blocks, moment by moment
(:func:`by_groups`, :mod:`effitrain.memory.layer_memory`), its gradients then made in the layouts
those replays left."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from effitrain.config.techniques import GRADIENT_CHECKPOINTING
from effitrain.memory.replay import replayed
from effitrain.memory.step_peak import breakdown, step_tracker


@dataclasses.dataclass
class Backward:
    """What a step's forward and backward leave at ``optimizer.step()``."""

    before: dict[str, int]  # the peak by category up to there
    at_step: dict[str, int]  # what is held there (weights, gradients, the last loss, the norm)
    gradients: list  # each parameter's, as the backward left it
    signature: tuple  # :func:`signature`
    held: dict | None = None  # at_step as the tracker's snapshot (device -> its kinds' bytes)


def forward_backward(replay, tracker=None) -> Backward:
    """The step's forward and backward under a tracker that knows only the model, to where it reaches
    ``optimizer.step()``. A later step's forward and backward are the first's: each starts with the
    gradients freed and the meter's running sums held (the replay's FLOP step made them), and the
    optimizer state it also holds is added per optimizer, as this tracker never sees it
    (``tests/memory/test_shared_traces.py`` holds both steps to full traces, byte for byte)."""
    found = {}
    with contextlib.ExitStack() as forward_backward:
        tracker = tracker if tracker is not None else step_tracker()
        tracker.track_external(replay.model)
        forward_backward.enter_context(tracker)

        def at_step():
            found["before"] = breakdown(tracker.get_tracker_snapshot("peak"))
            found["held"] = tracker.get_tracker_snapshot("current")
            found["at_step"] = breakdown(found["held"])
            forward_backward.close()  # what follows is each optimizer's, not the shared part's
            found["gradients"] = [p.grad for p in replay.model.parameters()]
            found["signature"] = signature(replay.model)

        replay.step(Pause(replay.model, at_step), tracker)
    return Backward(**found)


@dataclasses.dataclass
class ByGroups:
    """The forward and backward's figures, and the eval phase's, of a model of many alike blocks, from
    replays of fewer (:mod:`effitrain.memory.layer_memory`), and the layout of each gradient."""

    before: dict[str, int]
    at_step: dict[str, int]
    evaluation: dict[str, int] | None
    layouts: dict  # (the block's place in its group or None outside the blocks, name) -> layout
    path: str  # the blocks' module list
    period: int

    def backward(self, model) -> Backward:
        """As :func:`forward_backward` leaves ``model``: its gradients made in their layouts."""
        for name, param in model.named_parameters():
            layout = self.layouts[_place(name, self.path, self.period)]
            param.grad = None if layout is None else torch.empty_strided(
                layout[0], layout[1], dtype=layout[2], device=layout[3]
            )  # fmt: skip
        gradients = [p.grad for p in model.parameters()]
        return Backward(self.before, self.at_step, gradients, signature(model))


def by_groups(config, cfg, batches: list[dict], device: str, eval_shapes: dict | None) -> ByGroups | None:
    """:class:`ByGroups` from replays of the model at two, three and four groups of blocks (of
    ``period`` blocks: what gradient checkpointing repeats; :data:`effitrain.memory.layer_memory.GROUPS`),
    or at three, four and five where a run's both ends are odd (``WIDER``), each moment extrapolated
    (:func:`effitrain.memory.layer_memory.extrapolated`); None where that is not exact (the caller
    replays the whole model)."""
    from effitrain.memory.layer_flops import alike, smaller
    from effitrain.memory.layer_memory import (
        GROUPS,
        WIDER,
        BothEndsOdd,
        NotExtrapolable,
        extrapolated,
        extrapolated_current,
        peak,
        worth_it,
    )
    from effitrain.util.compat import timeline_tracker_class

    tracker_class = timeline_tracker_class()
    layers, period = getattr(config, "num_hidden_layers", None), GRADIENT_CHECKPOINTING.every(cfg) or 1
    if tracker_class is None or not worth_it(layers, period) or not alike(config):
        return None
    replays: dict = {}  # groups -> what its replay found (None: its blocks are not one module list)

    def replay_at(groups: int):
        if groups in replays:
            return replays[groups]
        with replayed(
            smaller(config, groups * period), cfg, batches, device, eval_shapes, count_flops=False
        ) as small:
            found = _blocks(small.model, groups * period)
            if found is None:
                replays[groups] = None
                return None
            path, blocks = found
            tracker = tracker_class(small.model, blocks)
            backward = forward_backward(small, tracker)
            evaluation = None
            if small.evaluation is not None:
                evaluation = tracker_class(small.model, blocks)
                evaluation.track_external(small.model)
                with evaluation:
                    small.evaluate(evaluation)
            replays[groups] = dict(
                path=path, timeline=tracker.timeline, held=backward.held,
                layouts=_layouts(small.model, backward.gradients, path, period),
                evaluation=evaluation.timeline if evaluation is not None else None,
            )  # fmt: skip
        return replays[groups]

    def extrapolate(sizes: tuple) -> ByGroups | None:
        found = [replay_at(groups) for groups in sizes]
        if None in found or len({f["path"] for f in found}) != 1:
            return None
        layouts = [f["layouts"] for f in found]
        if None in layouts or layouts[0] != layouts[1] or layouts[1] != layouts[2]:
            return None
        before = peak(extrapolated([f["timeline"] for f in found], layers, period, sizes))
        at_step = extrapolated_current([f["held"] for f in found], layers, period, sizes)
        evaluation = None
        if found[0]["evaluation"] is not None:
            evaluation = breakdown(
                peak(extrapolated([f["evaluation"] for f in found], layers, period, sizes))
            )
        return ByGroups(
            breakdown(before), breakdown(at_step), evaluation, layouts[0], found[0]["path"], period
        )

    try:
        try:
            return extrapolate(GROUPS)
        except BothEndsOdd:
            return extrapolate(WIDER) if worth_it(layers, period, WIDER) else None
    except NotExtrapolable:
        return None


def _blocks(model, layers: int):
    """(path, the module list) of ``model``'s ``layers`` blocks; None unless exactly one list holds them."""
    lists = [
        (n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers
    ]
    return lists[0] if len(lists) == 1 else None


def _place(name: str, path: str, period: int) -> tuple:
    """A parameter's place, alike in every model of these blocks: (its block's place in its group of
    ``period``, its name in the block) inside the module list at ``path``; (None, its name) outside."""
    if not name.startswith(f"{path}."):
        return None, name
    block, rest = name[len(path) + 1 :].split(".", 1)
    return int(block) % period, rest


def _layouts(model, gradients: list, path: str, period: int) -> dict | None:
    """Each of ``gradients``' layout (shape, strides, dtype, device; None: none), by its parameter's
    name outside the blocks and by its place in its group of ``period`` blocks inside them; None
    where a gradient is not alone on a storage of its own size from its start, or where the groups'
    layouts differ."""
    layouts, storages = {}, set()
    for (name, _), grad in zip(model.named_parameters(), gradients):
        key = _place(name, path, period)
        layout = None
        if grad is not None:
            storage = grad.untyped_storage()
            if (
                grad.storage_offset()
                or storage.nbytes() != grad.numel() * grad.element_size()
                or id(storage) in storages
            ):
                return None
            storages.add(id(storage))
            layout = (tuple(grad.shape), grad.stride(), grad.dtype, grad.device)
        if layouts.setdefault(key, layout) != layout:
            return None
    return layouts


def signature(model) -> tuple:
    """Every parameter's and gradient's shape, dtype, strides, offset and storage (its size, and
    which earlier tensor shares it): what an optimizer's step allocates around depends on no more."""
    storages: dict[int, int] = {}

    def described(tensor):
        if tensor is None:
            return None
        storage = tensor.untyped_storage()
        shared = storages.setdefault(id(storage), len(storages))
        return (tuple(tensor.shape), str(tensor.dtype), tensor.stride(), tensor.storage_offset(),
                storage.nbytes(), shared)  # fmt: skip

    return tuple(
        (name, described(p), p.requires_grad, described(p.grad)) for name, p in model.named_parameters()
    )


class Pause:
    """Stands in for the optimizer in the shared forward and backward: its ``step`` is where the
    forward and backward end; ``zero_grad`` frees the gradients as each optimizer's would."""

    def __init__(self, model, step):
        self.model, self.step = model, step

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.model.parameters():
            param.grad = None
