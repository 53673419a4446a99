"""The private APIs of torch, transformers, accelerate and datasets that effitrain uses, in one place.

An underscore name is no promise: any release may rename or drop it. effitrain reaches each one
only through this module, behind a version guard: it is used only on releases below
``CHECKED_BELOW`` (pyproject.toml's upper bounds, the releases it was checked on) and only when it
is there; otherwise the entry's fallback says what happens (a slower path, an unpatched mask, or an
error that names the API). ``tests/util/test_compat.py`` checks every entry on the installed releases
and fails loudly, naming the entry, when an upgrade changes one, or when pyproject.toml admits a
release this module was not checked on.

Checked on torch 2.13, transformers 5.23, accelerate 1.15, datasets 5.2.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import weakref
from importlib.metadata import version

log = logging.getLogger(__name__)

# The first release of each library not checked here: pyproject.toml's upper bound. Raising a
# bound there means checking this library's entries below (tests/util/test_compat.py insists).
CHECKED_BELOW = {"torch": "2.15", "transformers": "6", "accelerate": "2", "datasets": "6"}


def checked(library: str) -> bool:
    """The installed ``library`` is a release the private APIs below were checked on."""
    return _release(_installed(library)) < _release(CHECKED_BELOW[library])


@functools.cache
def _installed(library: str) -> str:
    """The installed release of ``library`` (read once: a lookup in the installed metadata costs
    milliseconds, and memory counting asks for every tensor it meets)."""
    return version(library)


def _release(text: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> (2, 13, 0): the release numbers, without local or pre-release parts."""
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", text).group().split("."))


def private(library: str, owner, name: str):
    """``owner.name`` when ``library`` is a checked release and has it; else None (the caller's fallback)."""
    if not checked(library):
        log.warning(
            "%s %s is newer than effitrain checked: not using its %s", library, version(library), name
        )
        return None
    return getattr(owner, name, None)


def _missing(library: str, name: str) -> RuntimeError:
    return RuntimeError(
        f"{library} {version(library)} has no {name}, a private API effitrain needs: "
        f"install {library}<{CHECKED_BELOW[library]} (see effitrain/util/compat.py)"
    )


# --- torch -------------------------------------------------------------------------------------


def mem_tracker_class():
    """torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, a private module)."""
    from torch.distributed._tools import mem_tracker

    return mem_tracker.MemTracker


@functools.cache
def step_peak_tracker_class():
    """A ``MemTracker`` that keeps only the whole step's peak, by overriding its private
    ``_update_peak_stats`` (reading ``_curr_mem_snap``, ``_peak_mem``, ``_peak_mem_snap`` and
    ``_TOTAL_KEY``), and that knows a module's gradients as gradients from ``track_external`` on
    (its private ``_track_module_params_and_buffers``): MemTracker installs its gradient hooks when
    a module's forward hook first fires, which never happens for the modules under a
    ``torch.compile`` wrapper, whose gradients it then counts as temporaries. Fallback: the full
    ``MemTracker``, slower, same peak (a compiled run's gradients among its temporaries)."""
    import gc

    import torch
    from torch.distributed._tools import mem_tracker

    tracker = mem_tracker.MemTracker
    if (
        private("torch", tracker, "_update_peak_stats") is None
        or private("torch", tracker, "_track_module_params_and_buffers") is None
        or not hasattr(mem_tracker, "_TOTAL_KEY")
    ):
        return tracker  # another torch's internals: the full tracker, slower, same peak

    class StepPeakTracker(tracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # A frozen parameter (an adapter's base weights) gets no gradient, and a gradient hook on
            # it raises: it is marked hooked already, with handles that remove nothing.
            from types import SimpleNamespace

            unhooked = SimpleNamespace(remove=lambda: None)
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (unhooked, unhooked)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def track_external(self, *external) -> None:
            super().track_external(*external)
            for module in external:
                if isinstance(module, torch.nn.Module):
                    self._track_module_params_and_buffers(module, install_grad_hooks=True)
            self._leaving_dead_graphs = [m for m in _modules(external) if _leaves_dead_graph(m)]

        def __enter__(self):
            # ModTracker's gradient hooks on a module's inputs make a reference cycle of their graph:
            # a graph a forward leaves unused (DoRA's B @ A, read only detached) then lives, its saved
            # tensors too, until Python's collector runs, where an untracked step frees it at once.
            # Collected after each such module's forward, the tracked step holds what the step holds.
            # The objects older than the step are frozen meanwhile, so that each collection scans only
            # the step's own (a pass over a whole process's objects takes a second).
            self._collecting = [
                m.register_forward_hook(_collect_garbage) for m in getattr(self, "_leaving_dead_graphs", [])
            ]
            if self._collecting:
                gc.freeze()
            return super().__enter__()

        def __exit__(self, *args):
            for handle in self._collecting:
                handle.remove()
            if self._collecting:
                gc.unfreeze()
            return super().__exit__(*args)

        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[mem_tracker._TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[mem_tracker._TOTAL_KEY]
                    self._peak_mem_snap[device] = dict(snapshot)  # flat: {category: bytes}

    return StepPeakTracker


def counting_like():
    """``count(tracker, tensor, like)``: torch's MemTracker ``tracker`` counts ``tensor``'s storage in
    the category it counts ``like``'s (nothing where it does not count ``like``'s), through its private
    ``_WINFO`` and ``_track``. None where torch lacks them (the caller replays what it would count)."""
    from torch.distributed._tools import mem_tracker

    if private("torch", mem_tracker.MemTracker, "_track") is None:
        return None

    def count(tracker, tensor, like) -> None:
        found = tracker._WINFO.get(like.untyped_storage())
        if found is not None:
            tracker._track(found[0].reftype, tensor)

    return count


@contextlib.contextmanager
def storages_counted_as(count, is_host):
    """Inside it, torch's MemTracker counts a storage as ``count(nbytes)`` where it counts it as
    ``nbytes``, unless ``is_host(storage, device)`` (a storage that stays on the CPU): its private
    ``_WeakRefInfo.create_winfo`` and ``_calculate_mem_consumed`` are replaced for the duration.
    Fallback: storages counted as they are (a warning says so)."""
    from torch.distributed._tools import mem_tracker

    info = private("torch", mem_tracker, "_WeakRefInfo")
    if info is None or not all(hasattr(info, name) for name in ("create_winfo", "_calculate_mem_consumed")):
        log.warning("torch %s: storages counted at their own size, not as CUDA's allocator holds them",
                    version("torch"))  # fmt: skip
        yield
        return
    saved = {name: info.__dict__[name] for name in ("create_winfo", "_calculate_mem_consumed")}
    create = info.create_winfo

    def counted(self) -> int:
        nbytes = self.size * self.element_size
        return nbytes if getattr(self, "host", True) else count(nbytes)

    def create_winfo(st, device, reftype, callback=None):
        winfo, ref = create(st, device, reftype, callback)
        winfo.host = is_host(st, device)
        winfo.mem_consumed = winfo._calculate_mem_consumed()
        return winfo, ref

    info.create_winfo, info._calculate_mem_consumed = create_winfo, counted
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(info, name, value)


def fake_process_group(rank: int, world_size: int) -> None:
    """The default process group as ``rank`` of ``world_size`` processes that are not there: torch's
    ``fake`` backend (``torch.testing._internal.distributed.fake_pg``, a testing module), whose
    collectives return at once and move nothing. No fallback: the per-rank prediction needs it."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed import fake_pg
    except ImportError:
        raise _missing("torch", "torch.testing._internal.distributed.fake_pg") from None
    store = private("torch", fake_pg, "FakeStore")
    if store is None:
        raise _missing("torch", "torch.testing._internal.distributed.fake_pg.FakeStore")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=store())


def fsdp_mem_tracker_class():
    """torch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``, a private module):
    ``MemTracker`` with FSDP2's categories (sharded and unsharded parameters and gradients, all-gather
    and reduce-scatter buffers). No fallback: the per-rank categories come from it."""
    from torch.distributed._tools import fsdp2_mem_tracker

    tracker = private("torch", fsdp2_mem_tracker, "FSDPMemTracker")
    if tracker is None:
        raise _missing("torch", "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker")
    return tracker


def _collect_garbage(*_) -> None:  # a forward hook: returning the count would replace the output
    import gc

    gc.collect()


def _modules(external) -> list:
    import torch

    return [m for module in external if isinstance(module, torch.nn.Module) for m in module.modules()]


def _leaves_dead_graph(module) -> bool:
    """peft's DoRA layer computes its update ``B @ A`` with gradients and uses only its detached norm."""
    try:
        from peft.tuners.lora.dora import DoraLinearLayer
    except ImportError:
        return False
    return isinstance(module, DoraLinearLayer)


def fake_tensor_mode():
    """A ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): tensors with shapes and no memory.
    No fallback: the step prediction cannot run without it."""
    from torch._subclasses import fake_tensor

    mode = private("torch", fake_tensor, "FakeTensorMode")
    if mode is None:
        raise _missing("torch", "torch._subclasses.fake_tensor.FakeTensorMode")
    return mode()


def values_assumed(assume):
    """A dispatch mode (``torch.utils._python_dispatch.TorchDispatchMode``) inside which a fake
    tensor's Python value (``.item()``, ``bool()``, ``.tolist()``: ``aten._local_scalar_dense``),
    where fake tensors cannot give it (``torch._subclasses.fake_tensor.DataDependentOutputException``),
    is ``assume(tensor)``; values fake tensors do know (constants) stay theirs. No fallback."""
    import torch
    from torch._subclasses import fake_tensor
    from torch.utils import _python_dispatch

    mode = private("torch", _python_dispatch, "TorchDispatchMode")
    unknown = private("torch", fake_tensor, "DataDependentOutputException")
    if mode is None or unknown is None:
        raise _missing("torch", "TorchDispatchMode and DataDependentOutputException")
    scalar = torch.ops.aten._local_scalar_dense.default

    class ValuesAssumed(mode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            try:
                return func(*args, **(kwargs or {}))
            except unknown:
                if func is not scalar:
                    raise
                return assume(args[0])

    return ValuesAssumed()


def is_traceable_wrapper_subclass(tensor) -> bool:
    """A tensor subclass that stores plain tensors inside (``torch.utils._python_dispatch``).
    Fallback: the protocol itself, a subclass with ``__tensor_flatten__``."""
    import torch
    from torch.utils import _python_dispatch

    check = private("torch", _python_dispatch, "is_traceable_wrapper_subclass")
    if check is not None:
        return check(tensor)
    return type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__")


def adam_step_dtype(fused: bool | None = None):
    """The dtype of Adam's ``step`` tensor (``torch.optim.optimizer._get_scalar_dtype``).
    Fallback: float32, torch's choice unless the default dtype is float64."""
    import torch
    from torch.optim import optimizer

    scalar_dtype = private("torch", optimizer, "_get_scalar_dtype")
    if scalar_dtype is None:
        return torch.float32
    return scalar_dtype(is_fused=fused) if fused is not None else scalar_dtype()


def tree_map(fn, tree):
    """``fn`` on every leaf of nested tuples, lists and dicts (``torch.utils._pytree.tree_map``).
    No fallback: the CUDA autocast replay casts a call's arguments with it."""
    from torch.utils import _pytree

    mapped = private("torch", _pytree, "tree_map")
    if mapped is None:
        raise _missing("torch", "torch.utils._pytree.tree_map")
    return mapped(fn, tree)


# CUDA's fused attention kernels, each its own aten op with a meta function (underscore names)
SDPA_KERNEL_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention")


def sdpa_kernel_op(name: str):
    """The aten op of one of :data:`SDPA_KERNEL_OPS`. No fallback: the CUDA replay of attention
    runs the kernel's own op, so that autograd keeps what its backward keeps."""
    import torch

    op = private("torch", torch.ops.aten, name)
    if op is None:
        raise _missing("torch", f"torch.ops.aten.{name}")
    return op


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process so far (dynamo's own timing,
    ``torch._dynamo.utils.compilation_time_metrics``). Fallback: NaN (unknown), not 0."""
    from torch._dynamo import utils

    metrics = private("torch", utils, "compilation_time_metrics")
    if metrics is None:
        return math.nan
    return float(sum(metrics.get("_compile.compile_inner", [])))


# --- transformers ------------------------------------------------------------------------------

# transformers decides, per batch, to build no attention mask when nothing is padded (sdpa).
MASK_SKIPPING = ("_ignore_bidirectional_mask_sdpa", "_ignore_causal_mask_sdpa")


@contextlib.contextmanager
def mask_skipping_replaced(follow):
    """Within, each of transformers' ``masking_utils`` deciders in :data:`MASK_SKIPPING` is
    ``follow(original)``; restored on exit. Fallback: a decider that is gone is left alone (the
    prediction then builds the mask transformers builds for padded batches)."""
    from transformers import masking_utils

    originals = {name: private("transformers", masking_utils, name) for name in MASK_SKIPPING}
    for name, original in originals.items():
        if original is not None:
            setattr(masking_utils, name, follow(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            if original is not None:
                setattr(masking_utils, name, original)


def checkpointing_wrapped(model, wrap) -> int:
    """Each of the model's checkpointed layers runs ``wrap(fn)`` where it ran ``fn`` under
    ``torch.utils.checkpoint``, in the forward and in the recomputation alike: transformers'
    ``_gradient_checkpointing_func`` (set by ``gradient_checkpointing_enable``) is wrapped. Returns
    how many layers were; fallback: none (0), which the caller reports."""
    from transformers import PreTrainedModel

    wrapped = 0
    for module in model.modules():
        if isinstance(module, PreTrainedModel):  # it holds the function too, for its layers to take
            continue
        original = private("transformers", module, "_gradient_checkpointing_func")
        if original is not None:
            module._gradient_checkpointing_func = functools.partial(
                lambda checkpoint, fn, *args, **kwargs: checkpoint(wrap(fn), *args, **kwargs), original
            )
            wrapped += 1
    return wrapped


def recomputation_tracked(fn):
    """``fn`` (a checkpointed layer's function) such that, when autograd recomputes it in backward
    under a ``MemTracker``, the tracker counts what it allocates as activations, MemTracker's own
    rule for recomputation. MemTracker finds recomputation by a module's forward hooks running in
    backward (its ``_in_ac``, ``_ac_mod``); transformers 5.17 checkpointed a layer's ``__call__``
    (hooks inside), later releases its ``forward`` (hooks outside), so only the submodules' hooks
    run and the layer's own ops between them (its residual sums) were counted as temporaries.
    Reads the mode stack (``torch.utils._python_dispatch._get_current_dispatch_mode_stack``) and
    ``torch._C._current_graph_task_id``. Fallback: ``fn`` as it is (that split, the same peak)."""
    import torch
    from torch.utils import _python_dispatch

    modes = private("torch", _python_dispatch, "_get_current_dispatch_mode_stack")
    in_backward = private("torch", torch._C, "_current_graph_task_id")
    if modes is None or in_backward is None:
        return fn
    tracker_class = mem_tracker_class()

    class Recomputation:  # what the tracker's _ac_mod refers to meanwhile: no submodule's hook ends it
        pass

    @functools.wraps(fn)
    def run(*args, **kwargs):
        trackers = [m for m in modes() if isinstance(m, tracker_class)]
        if not trackers or in_backward() == -1 or trackers[-1]._in_ac:
            return fn(*args, **kwargs)
        tracker, region = trackers[-1], Recomputation()
        tracker._ac_mod, tracker._in_ac = weakref.ref(region), True
        try:
            return fn(*args, **kwargs)
        finally:  # also when the recomputation stops early (it raises once it has what backward needs)
            tracker._ac_mod, tracker._in_ac = None, False

    return run


def attention_implementation(config) -> str:
    """The attention a transformers model runs (``PretrainedConfig._attn_implementation``).
    Fallback: sdpa, transformers' default where torch has it."""
    return private("transformers", config, "_attn_implementation") or "sdpa"


# --- accelerate --------------------------------------------------------------------------------


def reset_accelerator_state() -> None:
    """Forget accelerate's process-wide precision and compile settings
    (``AcceleratorState._reset_state``), keeping the process group. No fallback: without it a job
    would inherit the previous job's settings, so a missing one is an error."""
    from accelerate.state import AcceleratorState

    reset = private("accelerate", AcceleratorState, "_reset_state")
    if reset is None:
        raise _missing("accelerate", "AcceleratorState._reset_state")
    reset(reset_partial_state=False)


# --- datasets ----------------------------------------------------------------------------------


def dataset_fingerprint(dataset) -> str:
    """What a ``datasets.Dataset`` holds, as datasets hashes it (``Dataset._fingerprint``). No
    fallback: the tokenized cache's key needs it."""
    fingerprint = private("datasets", dataset, "_fingerprint")
    if fingerprint is None:
        raise _missing("datasets", "Dataset._fingerprint")
    return fingerprint
