"""Many optimizers' traces from one forward and backward: what :func:`effitrain.memory.replay.trace_run`
finds for each, phase by phase and category by category, at the cost of one model's replay.

    effitrain estimate model=distilbert_base_cased --device cuda   # every optimizer, one replay

The forward and backward of a step, its clipping and an evaluation do not depend on the optimizer,
and a later step's forward and backward are the first's: they are replayed once, and each
optimizer's own first and later steps are replayed on top of them, from the moment the step reaches
``optimizer.step()``, on the very gradients the backward left. A phase's peak is then
composed as the tracker of a full trace finds it. ``MemTracker`` keeps the categories at the moment
the total first reaches its highest value (a later moment replaces it only when strictly higher),
so a phase's peak is either

- the forward and backward's peak, plus the optimizer state held throughout it (none before the
  first step, whose ``optimizer.step`` creates it; all of it in a later step and in evaluation), or
- the optimizer step's own peak, plus what the step found held when it began (weights, gradients,
  the state, and the last micro-batch's loss and the gradient norm the step still holds),

whichever total is higher, the first on a tie. The two parts' tensors are disjoint (the forward's
residue is not the optimizer's), so the sums are exact; ``tests/memory/test_shared_traces.py`` holds every
optimizer of conf/optimizer to a full trace, to the byte. With the optimizer's update inside backward
(``optimizer_in_backward``) there is no backward to share: each optimizer is replayed in full.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from effitrain.config.techniques import ACTIVATION_OFFLOADING, OPTIMIZER_IN_BACKWARD
from effitrain.memory.fake_window import reuse_key, reused, reused_already
from effitrain.memory.predicted import BOUND_ASSUMED_BRANCH
from effitrain.memory.replay import Trace, completed, counted_state, replayed, trace_run
from effitrain.memory.shared_backward import Backward, by_groups, forward_backward
from effitrain.memory.step_peak import CATEGORIES, HOST_OFFLOADED, breakdown, step_tracker


@dataclasses.dataclass
class StepReplays:
    """Optimizer steps replayed for earlier candidates of one ``plan``, reused for later ones. A step
    depends on the parameters, their gradients, the optimizer's node and the device profile, not on
    the micro batch, checkpointing or precision that produced the gradients: a record is reused only
    where every parameter's and gradient's shape, dtype, strides and storage match (:func:`effitrain.memory.shared_backward.signature`).
    """

    records: dict = dataclasses.field(default_factory=dict)  # (optimizer key, signature) -> record
    reused: set = dataclasses.field(default_factory=set)  # names whose steps were reused, last call


def trace_runs(config, optimizer_cfgs: dict, cfg, batches: list[dict], device: str = "cpu",
               eval_shapes: dict | None = None, steps: StepReplays | None = None) -> dict[str, Trace]:  # fmt: skip
    """:func:`effitrain.memory.replay.trace_run` for each of ``optimizer_cfgs`` (name -> optimizer
    node), sharing one replay of the model: a :class:`Trace` per name, equal to the full trace's.
    ``steps``: optimizer steps replayed before, reused where they match (and added to)."""
    if OPTIMIZER_IN_BACKWARD.on(cfg):  # each update inside the backward: no backward to share
        if steps is not None:
            steps.reused = set()
        return {
            name: trace_run(config, node, cfg, batches, device, eval_shapes)
            for name, node in optimizer_cfgs.items()
        }
    steps = steps if steps is not None else StepReplays()
    steps.reused = set()
    analytic = {name: counted_state(config, node, cfg, device) for name, node in optimizer_cfgs.items()}
    keys = {name: _optimizer_key(node, cfg.weight_decay, device) for name, node in optimizer_cfgs.items()}
    traces = {name: Trace({}, 0) for name in optimizer_cfgs}
    records: dict[str, dict] = {}  # name -> its steps' record, replayed here or reused
    fallback: set[str] = set()  # a record reused for the first step that does not fit the later one
    # fewer blocks, where exact; the eval phase too, unless an earlier replay of plan's search has it
    evaluated = eval_shapes is not None and not reused_already(
        lambda: eval_key(config, cfg, eval_shapes, device)
    )
    groups = by_groups(config, cfg, batches, device, eval_shapes if evaluated else None)
    with replayed(config, cfg, batches, device, eval_shapes) as replay:
        optimizers = {name: replay.optimizer(node) for name, node in optimizer_cfgs.items()}
        # a later step's are the first's: see forward_backward
        backward = groups.backward(replay.model) if groups else forward_backward(replay)
        for phase in ("first_step", "later_step"):
            _each_step(replay, optimizers, phase, backward, traces, records, steps, keys, fallback)
        for param in replay.model.parameters():  # as the later step's zero_grad leaves them
            param.grad = None
        if replay.evaluation is not None:  # traced, or inside plan's search reused (eval_key)
            replay.phases["eval"] = dict(
                reused(
                    lambda: eval_key(config, cfg, eval_shapes, device),
                    lambda: groups.evaluation if groups else _eval_phase(replay),
                )
            )
            weights = _held(replay.model)
            for name, optimizer in ((n, o) for n, o in optimizers.items() if n not in fallback):
                if name not in steps.reused:  # the state held throughout evaluation
                    records[name]["eval"] = _minus(_held(replay.model, optimizer), weights)
                traces[name].phases["eval"] = _plus(replay.phases["eval"], records[name]["eval"])
    for name, record in records.items():
        if name not in fallback:
            steps.records.setdefault((keys[name], record["first_step_signature"]), record)
    for name, trace in traces.items():
        if name in fallback:  # replayed in full, alone
            traces[name] = trace_run(config, optimizer_cfgs[name], cfg, batches, device, eval_shapes)
            continue
        trace.flops, trace.recomputed_flops = replay.flops, replay.recomputed_flops
        completed(trace, analytic[name], config, cfg, device)
    return traces


def _eval_phase(replay) -> dict[str, int]:
    replay.tracked("eval", replay.evaluate)
    return replay.phases["eval"]


# The memory techniques that change nothing in a forward under ``no_grad`` in eval mode: offloading
# moves what backward saves (nothing is saved), the update in backward runs on gradients
# (tests/memory/test_shared_traces.py holds each eval phase to the one without; checkpointing's is its own).
TRAINING_ONLY = (ACTIVATION_OFFLOADING, OPTIMIZER_IN_BACKWARD)


def eval_key(config, cfg, eval_shapes: dict, device: str) -> str:
    """What the shared replay's eval phase (the model's weights and an eval batch's forward under
    ``no_grad``; the optimizer's state is added per optimizer) depends on: all
    :func:`effitrain.memory.fake_window.reuse_key` names but the optimizer, micro batch, accumulation
    and the techniques of training only (:data:`TRAINING_ONLY`)."""
    left_out = {"optimizer", "micro_batch_size", "effective_batch_size", "gradient_accumulation_steps"}
    left_out |= {technique.key for technique in TRAINING_ONLY}
    return reuse_key("eval", config, cfg, eval_shapes, device, left_out)


def _each_step(replay, optimizers: dict, phase: str, backward: Backward, traces: dict, records: dict,
               steps: StepReplays, keys: dict, fallback: set) -> None:  # fmt: skip
    """Each optimizer's ``phase`` step under a tracker of its own, on the gradients of ``backward``
    (or its record, where ``steps`` holds one for these gradients; ``fallback`` gets the names whose
    record matched the first step's gradients and not the later step's), composed with the forward
    and backward's peak into the phase's."""

    def as_the_backward_left_them():  # the gradients, whatever an earlier optimizer's step did
        for param, grad in zip(replay.model.parameters(), backward.gradients):
            param.grad = grad

    as_the_backward_left_them()
    held = _held(replay.model)  # weights and gradients
    signature = backward.signature
    for name, optimizer in optimizers.items():
        record = records.setdefault(name, {})
        if phase == "first_step" and (keys[name], signature) in steps.records:
            record.update(steps.records[keys[name], signature])
            steps.reused.add(name)
        elif name in steps.reused or name in fallback:
            if record.get(f"{phase}_signature") != signature:  # recorded on other gradients
                steps.reused.discard(name)
                fallback.add(name)
                continue
        else:
            as_the_backward_left_them()
            record[phase] = _own_step(replay, optimizer, held)
            record[f"{phase}_signature"] = signature
        state, delta, bounded = record[phase]
        stepped = _plus(backward.at_step, _plus(state, delta))
        forward = _plus(backward.before, state)
        traces[name].phases[phase] = stepped if stepped["total"] > forward["total"] else forward
        # the host's offloaded copies peak in the forward, which every optimizer shares
        traces[name].phases[phase][HOST_OFFLOADED] = backward.before.get(HOST_OFFLOADED, 0)
        if bounded:
            traces[name].bounds[phase] = BOUND_ASSUMED_BRANCH


def _own_step(replay, optimizer, held: dict) -> tuple[dict, dict, bool]:
    """``optimizer``'s step under a tracker of its own: the state it held before (by category), its
    peak less what it found held, and whether a branch was assumed."""
    own = step_tracker()
    own.track_external(replay.model, optimizer)
    entry = breakdown(own.get_tracker_snapshot("current"))
    replay.assumed.clear()
    with own:
        optimizer.step()
    delta = _minus(breakdown(own.get_tracker_snapshot("peak")), entry)
    return _minus(entry, held), delta, torch.bool in replay.assumed


def _optimizer_key(node, weight_decay: float, device: str) -> str:
    from omegaconf import OmegaConf

    return json.dumps([OmegaConf.to_container(node, resolve=True), weight_decay, device], sort_keys=True)


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
    return {
        **total,
        "total": sum(total.values()),
        HOST_OFFLOADED: a.get(HOST_OFFLOADED, 0) + b.get(HOST_OFFLOADED, 0),
    }


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return _plus(a, {**{c: -b[c] for c in CATEGORIES}, HOST_OFFLOADED: -b.get(HOST_OFFLOADED, 0)})
