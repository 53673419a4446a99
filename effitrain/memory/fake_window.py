"""The recorded micro-batches of one optimizer step as fake zeros, ready to replay: what the
prediction (:mod:`effitrain.memory.replay`, :mod:`effitrain.memory.sharded`) steps through.

A micro-batch inside a run of equal ones is left out, the same bytes (:func:`replayed_as`); its
FLOPs are the replayed one's (:func:`window_flops`), and inside plan's search one count serves
every replay whose FLOPs are the same (:func:`reused_in_search`); a batch recorded without padding
skips the attention mask as it did (:func:`mask_skipping_as_recorded`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from effitrain.util.compat import mask_skipping_replaced


def fake_batch(shapes: dict) -> dict:
    """Zeros of the recorded shapes and dtypes (an attention mask of ones): made under fake mode."""
    batch = {}
    for key, (shape, dtype) in ((k, v) for k, v in shapes.items() if k != "padded"):
        batch[key] = (
            torch.ones(shape, dtype=dtype) if key == "attention_mask" else torch.zeros(shape, dtype=dtype)
        )
    return batch


@dataclasses.dataclass
class FakeWindow:
    """A step's recorded micro-batches as fake zeros (:func:`fake_window`), made under fake mode."""

    batches: list[dict]  # the micro-batches replayed
    evaluation: dict | None  # the eval batch
    items: int  # the items (labels) of the whole recorded window
    unpadded: set[int]  # ids of the attention masks recorded without padding (mask_skipping_as_recorded)
    # per recorded micro-batch, the index in ``batches`` of the first with its shapes (its FLOPs)
    shaped_as: list[int]
    # id(a replayed batch) -> the left-out (batch, the one replayed in its place) pairs to count before it begins
    left_out: dict[int, list[tuple[dict, dict]]]

    def stepper(self, task, model, meter, ops):
        """``step(optimizer, tracker=None, before_forward=None, only=None)``: :func:`window_step` over
        ``batches`` (those of the indices ``only``). Under ``tracker``: fresh module stats per
        micro-batch (as ``StepMemory.saw``) and, before a micro-batch that ends a run of repeats, the
        left-out ones' tensors counted as those of the one replayed in their place were (:func:`replayed_as`)."""
        from effitrain.train.step import window_step
        from effitrain.util.compat import counting_like

        count = counting_like()

        def step(optimizer, tracker=None, before_forward=None, only=None):
            batches = self.batches if only is None else [self.batches[index] for index in only]

            def begin(batch):
                if tracker is not None:
                    tracker.reset_mod_stats()
                    for left_out, stand_in in self.left_out.get(id(batch), ()):
                        for key, tensor in left_out.items():
                            count(tracker, tensor, stand_in[key])
                if before_forward is not None:
                    before_forward(batch)

            return window_step(task, model, optimizer, batches, self.items, meter, ops, begin)

        return step


def fake_window(batches: list[dict], eval_shapes: dict | None, synchronized_last: bool = False,
                every_micro_batch: bool = False) -> FakeWindow:  # fmt: skip
    """The recorded micro-batches and eval batch as fake zeros (:func:`fake_batch`, made under fake
    mode), the repeats left out (:func:`replayed_as`; ``synchronized_last``: a sharded step's) unless
    ``every_micro_batch``."""
    from effitrain.util.compat import counting_like

    window = [fake_batch(shapes) for shapes in batches]
    leave_out = not every_micro_batch and counting_like() is not None
    stands_for = replayed_as(batches, synchronized_last) if leave_out else list(range(len(batches)))
    kept = [index for index, stand_in in enumerate(stands_for) if stand_in == index]
    left_out: dict[int, list[tuple[dict, dict]]] = {}
    for index, stand_in in enumerate(stands_for):
        if stand_in != index:  # counted before the next replayed one, the last of its run, begins
            ends_run = next(k for k in kept if k > index)
            left_out.setdefault(id(window[ends_run]), []).append((window[index], window[stand_in]))
    evaluation = fake_batch(eval_shapes) if eval_shapes is not None else None
    unpadded = {
        id(b["attention_mask"])
        for b, s in [*zip(window, batches), (evaluation, eval_shapes)]
        if b is not None and "attention_mask" in b and not s.get("padded", True)
    }
    return FakeWindow(
        [window[k] for k in kept], evaluation, sum(len(b["labels"]) for b in window), unpadded,
        [next(n for n, k in enumerate(kept) if batches[k] == shapes) for shapes in batches], left_out,
    )  # fmt: skip


def replayed_as(batches: list[dict], synchronized_last: bool = False) -> list[int]:
    """For each recorded micro-batch, the one replayed in its place: itself, or the first of its run
    when it lies inside a run of micro-batches of the same shapes (neither the run's first nor last).

    From the second micro-batch on, each starts with the gradients made and the meter's running sums
    and the last loss held (0-d tensors), and leaves them as it found them, except for the tensors of
    its own batch that MemTracker came to count (a view of the labels a causal LM shifts, of the
    inputs GPT-2 reshapes): the run's last, replayed, holds what it would have held once the left-out
    ones' tensors are counted as the run's first's were (:meth:`FakeWindow.stepper`), and its highest
    point is at least any left-out one's (above it by the batch tensors counted since; else equal,
    category by category). ``synchronized_last``: the last micro-batch synchronizes the gradients (a
    sharded step), so the one before it ends its run. ``tests/memory/test_replay.py`` holds this to
    full windows, byte for byte."""
    last_inside = len(batches) - (3 if synchronized_last else 2)
    stands_for: list[int] = []
    for index, shapes in enumerate(batches):
        inside = 1 <= index <= last_inside and batches[index - 1] == shapes == batches[index + 1]
        stands_for.append(stands_for[-1] if inside else index)
    return stands_for


def window_flops(window: FakeWindow, step, optimizer) -> int:
    """The FLOPs of one optimizer step over the whole recorded window: ``step`` replays one micro-batch
    of each shape under ``FlopCounterMode``, each one's count read as the next begins, and every
    recorded micro-batch counts as the one of its shapes (FlopCounterMode counts matrix products,
    which the shapes decide: ``tests/memory/test_replay.py`` holds this to full windows)."""
    from torch.utils.flop_counter import FlopCounterMode

    distinct = sorted(set(window.shaped_as))
    marks: list[int] = []
    with FlopCounterMode(display=False) as counter:
        step(optimizer, before_forward=lambda batch: marks.append(counter.get_total_flops()), only=distinct)
        marks.append(counter.get_total_flops())
    own = dict(zip(distinct, (after - before for before, after in zip(marks, marks[1:]))))
    return sum(own[index] for index in window.shaped_as)


@contextlib.contextmanager
def mask_skipping_as_recorded(model, unpadded: set[int]):
    """transformers skips building an attention mask for a batch without padding, a decision it
    cannot take on fake tensors (it assumes padding). Take it as the recorded micro-batch did: a
    hook on the model's forward notes which micro-batch is running."""
    current = {"unpadded": False}

    def note(module, args, kwargs):
        current["unpadded"] = id(kwargs.get("attention_mask")) in unpadded

    def follow(original):
        def decide(*args, **kwargs):
            return True if current["unpadded"] else original(*args, **kwargs)

        return decide

    hook = model.register_forward_pre_hook(note, with_kwargs=True)
    try:
        with mask_skipping_replaced(follow):
            yield
    finally:
        hook.remove()


# What plan's search counted once and reuses, by key (:func:`flops_key`, and the shared replay's eval
# phase by ``effitrain.memory.shared_traces.eval_key``), inside :func:`reused_in_search` only (None:
# every replay counts its own, so two paths a test compares are two counts)
_REUSED: dict[str, object] | None = None


@contextlib.contextmanager
def reused_in_search(known: dict | None = None):
    """Inside, one count of the model's FLOPs serves every replay of the same model, batch shapes and
    device (a plan's precisions, optimizers and memory techniques), one count of what a technique
    setting recomputes every replay with that setting, and one eval phase every replay that differs
    only in its optimizer and micro batch. FlopCounterMode counts matrix products, which the shapes
    decide; evaluation runs neither the optimizer nor a training batch: tests/memory/test_replay.py
    and tests/memory/test_shared_traces.py hold each reused figure equal to a fresh one. ``known``:
    the figures of an earlier search, added to (a new one by default)."""
    global _REUSED
    saved, _REUSED = _REUSED, (known if known is not None else {} if _REUSED is None else _REUSED)
    try:
        yield
    finally:
        _REUSED = saved


def reused(key, compute):
    """``compute()``, or inside :func:`reused_in_search` the value already computed under ``key()``."""
    if _REUSED is None:
        return compute()
    known = key()
    if known not in _REUSED:
        _REUSED[known] = compute()
    return _REUSED[known]


def reused_already(key) -> bool:
    """Whether inside :func:`reused_in_search` a figure is already filed under ``key()``."""
    return _REUSED is not None and key() in _REUSED


def reuse_key(kind: str, config, cfg, shapes, device: str, left_out: set[str]) -> str:
    """The key :func:`reused` files a ``kind`` of figure under: the model's config, the run's
    configuration but the keys ``left_out`` (and Hydra's own node), the shapes replayed and the
    device's kernels."""
    import json

    from omegaconf import OmegaConf

    run = {k: v for k, v in OmegaConf.to_container(cfg).items() if k not in left_out | {"hydra"}}
    return json.dumps([kind, config.to_dict(), run, repr(shapes), device], sort_keys=True, default=str)


def flops_key(config, cfg, batches: list[dict], device: str, techniques: bool) -> str:
    """What a step's FLOPs depend on: all :func:`reuse_key` names but the precision and optimizer
    (the optimizer counted is a plain SGD; autocast changes no product's shape); the memory
    techniques' keys only for what they recompute (``techniques``): the model's FLOPs are counted
    before they apply. The chunked loss is the exception: it is the loss, not a change applied to
    the model, and runs the LM head on the positions that have a target only (a row's last has
    none), so the model's FLOPs depend on it."""
    from effitrain.config.techniques import LOSS_CHUNKS, TECHNIQUES

    applied = {t.key for t in TECHNIQUES if t is not LOSS_CHUNKS}
    left_out = {"precision", "optimizer"} | (applied if not techniques else set())
    return reuse_key("flops", config, cfg, batches, device, left_out)
