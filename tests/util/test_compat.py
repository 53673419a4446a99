"""The private library APIs of effitrain/util/compat.py, each against the installed release: when an
upgrade renames or changes one, the test of that entry fails and names it."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from effitrain.util import compat
from tests.helpers.run import REPO


def test_pyproject_admits_only_releases_compat_was_checked_on():
    """Raising an upper bound in pyproject.toml means rechecking that library's private APIs."""
    # the project's requirements, "name>=low,<high" (tomllib is not in Python 3.10)
    bounds = dict(
        re.findall(
            r'^\s*"([A-Za-z0-9_.-]+)>=[^",]+,<([0-9.]+)",', (REPO / "pyproject.toml").read_text(), re.M
        )
    )
    assert bounds["torch"] == "2.15" and bounds["transformers"] == "6"  # read as written
    for library, below in compat.CHECKED_BELOW.items():
        assert bounds.get(library) == below, (
            f"pyproject.toml: {library}<{bounds.get(library)}; compat: <{below}"
        )
        assert compat.checked(library), f"the installed {library} is outside compat.CHECKED_BELOW"


def test_the_guard_refuses_a_release_beyond_the_checked_ones(monkeypatch):
    monkeypatch.setitem(compat.CHECKED_BELOW, "torch", "2.0")
    assert not compat.checked("torch")
    assert compat.private("torch", torch, "_C") is None  # there, but not used on an unchecked torch
    assert compat.adam_step_dtype() == torch.float32  # the fallback
    assert compat._release("2.13.0+cpu") == (2, 13, 0) and compat._release("6") == (6,)


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


def test_transformers_mask_skipping_deciders_say_skip_for_an_unpadded_batch():
    """True means "build no mask": for no padding mask at all, and not for a padded batch."""
    from transformers import masking_utils

    causal = masking_utils._ignore_causal_mask_sdpa
    bidirectional = masking_utils._ignore_bidirectional_mask_sdpa
    padded = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    assert causal(padding_mask=None, q_length=4, kv_length=4, q_offset=0, kv_offset=0) is True
    assert causal(padding_mask=padded, q_length=4, kv_length=4, q_offset=0, kv_offset=0) is False
    assert bidirectional(padding_mask=None, kv_length=4) is True
    assert bidirectional(padding_mask=padded, kv_length=4) is False
    calls = []

    def follow(original):
        def decide(*args, **kwargs):
            calls.append(original.__name__)
            return original(*args, **kwargs)

        return decide

    with compat.mask_skipping_replaced(follow):
        assert masking_utils._ignore_bidirectional_mask_sdpa(padding_mask=None, kv_length=4) is True
        assert masking_utils._ignore_causal_mask_sdpa(None, 4, 4, 0, 0) is True
    assert calls == ["_ignore_bidirectional_mask_sdpa", "_ignore_causal_mask_sdpa"]
    assert masking_utils._ignore_causal_mask_sdpa is causal  # restored
    assert masking_utils._ignore_bidirectional_mask_sdpa is bidirectional


def test_transformers_checkpointing_function_is_what_recomputation_calls():
    """Every checkpointed layer of a model calls its _gradient_checkpointing_func with the function
    it recomputes: wrapping it sees the forward once and the recomputation once per layer."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    calls = []

    def wrap(fn):
        def counted(*args, **kwargs):
            calls.append(torch.is_grad_enabled())
            return fn(*args, **kwargs)

        return counted

    assert compat.checkpointing_wrapped(model, wrap) == 2
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 4  # two layers: each forward, then each recomputation in backward


def test_accelerate_state_reset_forgets_the_precision_and_keeps_the_process():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    compat.reset_accelerator_state()
    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
    assert Accelerator(cpu=True).mixed_precision == "bf16"  # the singleton: the first job's setting stays
    compat.reset_accelerator_state()
    assert AcceleratorState._shared_state == {}
    assert PartialState._shared_state != {}  # the process group stays
    assert Accelerator(cpu=True).mixed_precision == "no"  # the next job sets its own precision
    compat.reset_accelerator_state()


def test_fake_tensors_have_shapes_and_no_memory():
    with compat.fake_tensor_mode():
        tensor = torch.ones(1000, 1000)
        assert type(tensor).__name__ == "FakeTensor" and tensor.shape == (1000, 1000)


def test_wrapper_subclass_check():
    plain = torch.ones(3)
    assert compat.is_traceable_wrapper_subclass(plain) is False
    assert compat.is_traceable_wrapper_subclass(torch.nn.Parameter(plain)) is False


@pytest.mark.parametrize("fused", [None, False])
def test_adam_step_dtype_is_what_adam_allocates(fused):
    param = torch.nn.Parameter(torch.ones(4))
    kwargs = {"capturable": False} if fused is None else {"fused": fused}
    optimizer = torch.optim.Adam([param], **kwargs)
    param.grad = torch.ones(4)
    optimizer.step()
    assert optimizer.state[param]["step"].dtype == compat.adam_step_dtype(fused)


def test_compile_seconds_counts_dynamo_compilation():
    before = compat.compile_seconds()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    assert compiled(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert compat.compile_seconds() > before >= 0.0


def test_dataset_fingerprint_follows_the_content():
    from datasets import Dataset

    data = Dataset.from_dict({"text": ["a", "b"]})
    fingerprint = compat.dataset_fingerprint(data)
    assert isinstance(fingerprint, str) and len(fingerprint) >= 8
    changed = data.map(lambda row: {"text": row["text"] + "!"})
    assert compat.dataset_fingerprint(changed) != fingerprint
    assert compat.dataset_fingerprint(data) == fingerprint


def test_tree_map_reaches_every_leaf_of_a_call_s_arguments():
    args = (1, [2, {"k": 3}], {"m": (4,)})
    assert compat.tree_map(lambda x: x * 10, args) == (10, [20, {"k": 30}], {"m": (40,)})


@pytest.mark.parametrize("name", compat.SDPA_KERNEL_OPS)
def test_cuda_attention_kernel_ops_run_on_fake_tensors_and_return_the_logsumexp(name):
    # the replay's premise: each kernel is its own op whose meta function gives what backward keeps
    op = compat.sdpa_kernel_op(name)
    with compat.fake_tensor_mode():
        q, k, v = (torch.ones(2, 3, 5, 8, dtype=torch.float16) for _ in range(3))
        if name.endswith("flash_attention"):
            out, logsumexp = op(q, k, v, 0.0, False, False)[:2]
        else:
            out, logsumexp = op(q, k, v, None, True, 0.0, False)[:2]
    assert tuple(out.shape) == (2, 3, 5, 8) and out.dtype == torch.float16
    assert logsumexp.dtype == torch.float32 and tuple(logsumexp.shape)[:2] == (2, 3)


def test_attention_implementation_is_what_the_model_runs():
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    for chosen in ("eager", "sdpa"):
        config._attn_implementation = chosen  # noqa: SLF001 (what from_pretrained sets)
        assert compat.attention_implementation(BertModel(config).config) == chosen


def test_a_recomputed_layer_s_own_ops_count_as_activations_with_its_hooks_outside():
    """A layer checkpointed by its ``forward`` (its hooks outside, as transformers>5.17 does): the
    sum it makes between its submodules, recomputed in backward, is an activation (MemTracker's
    rule for recomputation), not a temporary; the peak itself does not move."""
    from torch.utils.checkpoint import checkpoint

    from effitrain.memory.step_peak import breakdown, step_tracker

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


def test_fake_process_group_makes_this_process_a_rank_of_a_larger_world():
    compat.fake_process_group(rank=0, world_size=8)
    try:
        assert torch.distributed.get_world_size() == 8 and torch.distributed.get_rank() == 0
        tensor = torch.ones(2)
        torch.distributed.all_reduce(tensor)  # returns at once, moves nothing
        assert tensor.tolist() == [1.0, 1.0]
    finally:
        torch.distributed.destroy_process_group()


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

    from effitrain.memory.step_peak import breakdown, step_tracker

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
    from effitrain.memory.step_peak import breakdown, step_tracker

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
