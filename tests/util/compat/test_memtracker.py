"""torch's MemTracker internals of effitrain/util/compat/memtracker.py, each against the installed
release: when an upgrade renames or changes one, the test of that entry fails and names it."""

from __future__ import annotations

import contextlib

import torch

from effitrain.util import compat


def test_mem_tracker_override_is_the_one_torch_calls():
    """``_update_peak_stats`` still exists with the signature the override replaces, and the
    override's step peak is MemTracker's own (same snapshot, fewer per-module peaks)."""
    import inspect

    from torch.distributed._tools import mem_tracker

    tracker_class = compat.step_peak_tracker_class()
    assert tracker_class is not compat.mem_tracker_class(), "the fallback: torch's internals changed"
    assert list(inspect.signature(mem_tracker.MemTracker._update_peak_stats).parameters) == [
        "self",
        "peak_state",
    ]
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    peaks = []
    for tracker in (tracker_class(), compat.mem_tracker_class()()):
        tracker.track_external(model, optimizer)
        with tracker:
            for iteration in range(2):  # the second step holds the optimizer state
                if iteration:
                    tracker.reset_mod_stats()
                model(torch.randn(32, 64)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        peaks.append(tracker.get_tracker_snapshot("peak"))
    totals = [sum(per_device[mem_tracker._TOTAL_KEY] for per_device in peak.values()) for peak in peaks]
    assert totals[0] == totals[1] > 64 * 256 * 4 * 4  # weights, grads and two AdamW moments at least


def test_a_recomputed_layer_s_own_ops_count_as_activations_with_its_hooks_outside():
    """A layer checkpointed by its ``forward`` (its hooks outside, as transformers>5.17 does): the
    sum it makes between its submodules, recomputed in backward, is an activation (MemTracker's
    rule for recomputation), not a temporary; the peak itself does not move."""
    from torch.utils.checkpoint import checkpoint

    from effitrain.memory.replay import breakdown, step_tracker

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.second(self.first(x) + x)  # the sum: the layer's own op

    peaks = {}
    for marked in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), Block())
        function = compat.recomputation_tracked(model[1].forward) if marked else model[1].forward
        inputs = torch.randn(256, 64)
        tracker = step_tracker()
        tracker.track_external(model)
        with tracker:
            output = checkpoint(function, model[0](inputs), use_reentrant=False)  # held: the peak in backward
            output.square().sum().backward()
        peaks[marked] = breakdown(tracker.get_tracker_snapshot("peak"))
    moved = 256 * 64 * 4  # the recomputed sum, fp32
    assert peaks[True]["activations"] - peaks[False]["activations"] == moved
    assert peaks[False]["temporaries"] - peaks[True]["temporaries"] == moved
    assert peaks[True]["total"] == peaks[False]["total"]


def test_fsdp_mem_tracker_has_the_categories_effitrain_maps():
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    from effitrain.memory.sharded import CATEGORY_OF

    assert compat.fsdp_mem_tracker_class().__name__ == "FSDPMemTracker"
    assert set(CATEGORY_OF) | {"Inputs"} == {kind.value for kind in _FSDPRefType}


def _autograd_nodes_in_garbage(model, tracker) -> int:
    """The matrix products' autograd nodes (``MmBackward0``: a Linear without bias, as DoRA's
    ``lora_B(lora_A(eye))``) unreachable after a tracked forward of ``model``, while the loss still
    holds the graph backward will use (found with Python's collector held during the forward, then
    run once)."""
    import gc

    batch = torch.randint(0, 1000, (4, 16))
    gc.collect()
    gc.disable()
    try:
        tracker.track_external(model)
        with tracker:
            loss = model(input_ids=batch, labels=torch.zeros(4, dtype=torch.long)).loss
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            nodes = sum(type(o).__name__ == "MmBackward0" for o in gc.garbage)
            gc.set_debug(0)
            loss.backward()
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return nodes


def test_the_step_tracker_frees_the_graph_a_dora_layer_leaves_unused():
    """MemTracker's module hooks make a cycle of the graph of DoRA's B @ A (read only detached), one
    per adapted Linear (13 in a 2-layer BERT): its saved tensors then outlive the forward until the
    collector runs. The step tracker collects it after each DoRA layer's forward."""
    import peft
    import transformers

    config = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, num_labels=3)  # fmt: skip
    adapter = peft.LoraConfig(r=4, target_modules="all-linear", task_type="SEQ_CLS", use_dora=True)

    def dora():
        return peft.get_peft_model(
            transformers.AutoModelForSequenceClassification.from_config(config), adapter
        )

    # MemTracker hooks every parameter, frozen or not (which raises): the models here train them all
    assert _autograd_nodes_in_garbage(dora().requires_grad_(True), compat.mem_tracker_class()()) >= 13
    assert _autograd_nodes_in_garbage(dora(), compat.step_peak_tracker_class()()) == 0


def test_storages_counted_as_is_what_mem_tracker_counts_and_is_undone_after():
    """MemTracker counts each storage through the replaced ``_WeakRefInfo``: 100 bytes as 128 inside,
    a storage said to stay on the host at its size (40), and every storage at its size once left."""
    from torch.distributed._tools import mem_tracker

    from effitrain.memory.replay import breakdown, step_tracker

    before = dict(vars(mem_tracker._WeakRefInfo))
    counted = []
    for replaced in (True, False):
        blocks = compat.storages_counted_as(lambda n: -(-n // 128) * 128, lambda st, device: st.size() == 40)
        with blocks if replaced else contextlib.nullcontext():
            tracker = step_tracker()
            with tracker:
                kept = [torch.empty(25), torch.empty(10)]  # noqa: F841  (held while the tracker reads)
                counted.append(breakdown(tracker.get_tracker_snapshot("current"))["total"])
    assert counted == [128 + 40, 100 + 40]
    assert dict(vars(mem_tracker._WeakRefInfo)) == before


def test_counting_like_counts_a_tensor_in_the_category_of_the_one_it_is_like():
    """``count(tracker, tensor, like)`` (replay's left-out micro-batches) adds ``tensor``'s bytes to
    the category MemTracker counts ``like``'s in: an activation, made inside the tracker; nothing for
    a ``like`` made before it, which it never counted."""
    from effitrain.memory.replay import breakdown, step_tracker

    count = compat.counting_like()
    assert count is not None
    outside, extra = torch.empty(7), torch.empty(12)  # made before the tracker; extra: 48 bytes
    tracker = step_tracker()
    with tracker:
        like = torch.empty(25)  # 100 bytes
        snapshots = [breakdown(tracker.get_tracker_snapshot("current"))]
        for seen in (outside, like):
            count(tracker, extra, seen)
            snapshots.append(breakdown(tracker.get_tracker_snapshot("current")))
    assert [(s["activations"], s["total"]) for s in snapshots] == [(100, 100), (100, 100), (148, 148)]


def test_the_timeline_tracker_records_each_moment_labelled_by_its_block():
    """The timeline tracker (its private ``_curr_mem_snap`` and ``_mod_tracker``) keeps the step
    tracker's peak, and its moments hold that peak; each moment is labelled by the block whose
    forward or backward runs, and clipping's norm of each block's gradients by that block."""
    from effitrain.util.compat.memtracker import MANY_BLOCKS

    timeline_class = compat.timeline_tracker_class()
    assert timeline_class is not None, "the fallback: torch's internals changed"

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Linear(8, 32), torch.nn.Linear(32, 2)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = torch.relu(block(x))
            return self.head(x)

    torch.manual_seed(0)
    model = Model()
    blocks = model.blocks
    peaks = []
    for tracker in (compat.step_peak_tracker_class()(), timeline_class(model, blocks)):
        tracker.track_external(model)
        with tracker:
            model(torch.randn(16, 8)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        peaks.append(tracker.get_tracker_snapshot("peak"))
        model.zero_grad(set_to_none=True)
    assert peaks[0] == peaks[1]
    moments = tracker.timeline
    totals = {device: max(m[device]["Total"] for _, m in moments if device in m) for device in peaks[1]}
    assert totals == {device: snapshot["Total"] for device, snapshot in peaks[1].items()}
    labels = [label for label, _ in moments]
    first_backward = next(i for i, (is_bw, _) in enumerate(labels) if is_bw)
    forward = [block for _, block in labels[:first_backward] if block not in (None, MANY_BLOCKS)]
    from itertools import groupby

    assert [block for block, _ in groupby(forward)] == [0, 1, 2]
    backward = [block for is_bw, block in labels if is_bw and block is not None]
    assert [block for block, _ in groupby(backward)] == [2, 1, 0]
    # clipping, outside every module: each block's gradient norms labelled by it, in order

    clipping = [block for backward, block in labels[labels.index((True, 0)) :] if not backward]
    assert [b for b, _ in groupby(clipping) if b not in (None, MANY_BLOCKS)][:3] == [0, 1, 2]
