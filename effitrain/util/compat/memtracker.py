"""torch's MemTracker (``torch.distributed._tools``, a private package) and the internals of it that
effitrain overrides or reads: the step tracker, counting a tensor like another, storages counted
as CUDA's allocator holds them, FSDP's tracker, recomputation counted as activations.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from importlib.metadata import version

from effitrain.util.compat.guard import log, missing, private
from effitrain.util.compat.huggingface import dora_layer_class


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


# A timeline's label for an operator that reads several blocks' tensors at once (a foreach over every
# gradient): a stretch of its own, outside the blocks' runs (effitrain.memory.layer_memory)
MANY_BLOCKS = -1


@functools.cache
def timeline_tracker_class():
    """The step tracker (:func:`step_peak_tracker_class`) that also records every moment of what it
    tracks: after each operator, the bytes by category of each device (its private
    ``_curr_mem_snap``) with a label, ``(in backward, block)``: the block whose forward or backward
    runs (its private ``_mod_tracker``'s ``parents``), else the block whose weights or gradients the
    operator reads (:data:`MANY_BLOCKS` for several). Built as
    ``TimelineTracker(model, blocks)``, ``blocks`` the module list of the model's blocks.
    None where torch lacks them (the caller replays the whole model)."""
    import re

    import torch
    from torch.utils._pytree import tree_leaves

    tracker = step_peak_tracker_class()
    if tracker is mem_tracker_class() or private("torch", tracker(), "_mod_tracker") is None:
        return None

    class TimelineTracker(tracker):
        def __init__(self, model, blocks):
            super().__init__()
            path = next(name for name, module in model.named_modules() if module is blocks)
            self._block_name = re.compile(rf"(?:^|\.){re.escape(path)}\.(\d+)$")
            self._named: dict[str, int | None] = {}
            self._weights = [(p, i) for i, block in enumerate(blocks) for p in block.parameters()]
            self._of_weight = {id(p): i for p, i in self._weights}
            self._args: tuple = ()
            # id -> (weak reference, block) of a tensor made from one block's tensors
            self._derived: dict[int, tuple] = {}
            self.timeline: list = []

        def __enter__(self):
            entered = super().__enter__()
            self.timeline.append(((False, None), self._snapshot()))  # the peak MemTracker starts from
            return entered

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # a query of a tensor's metadata (its device) reads no block's data: no block's label
            self._args = () if func.namespace == "prim" else (args, kwargs)
            self._made_from = None
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self._args = ()  # held no longer than the step would hold them
            if self._made_from is not None:  # its outputs are that block's (a gradient's norm, say)
                for tensor in (t for t in tree_leaves(out) if torch.is_tensor(t)):
                    self._derived[id(tensor)] = weakref.ref(tensor), self._made_from
            return out

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            snapshot = self._snapshot()
            # a moment that holds what the one before held cannot be the first to reach a peak:
            # not recorded (a device query, a view, an update in place)
            if snapshot != self.timeline[-1][1]:
                self.timeline.append((self._label(), snapshot))

        def _snapshot(self) -> dict:
            return {device: dict(snapshot) for device, snapshot in self._curr_mem_snap.items()}

        def _in_block(self, name: str):
            if name not in self._named:
                found = self._block_name.search(name)
                self._named[name] = int(found.group(1)) if found else None
            return self._named[name]

        def _label(self) -> tuple:
            modules = self._mod_tracker
            inside = {b for b in map(self._in_block, modules.parents) if b is not None}
            if inside:
                return modules.is_bw, inside.pop() if len(inside) == 1 else MANY_BLOCKS
            # outside every block: the block whose weights or gradients (or what was made from them) it reads
            of = {**self._of_weight, **{id(p.grad): i for p, i in self._weights if p.grad is not None}}
            for tensor in (t for t in tree_leaves(self._args) if torch.is_tensor(t)):
                if id(tensor) in of:
                    inside.add(of[id(tensor)])
                elif (made := self._derived.get(id(tensor))) is not None and made[0]() is tensor:
                    inside.add(made[1])
            block = None if not inside else inside.pop() if len(inside) == 1 else MANY_BLOCKS
            self._made_from = block if block not in (None, MANY_BLOCKS) else None
            return modules.is_bw, block

    return TimelineTracker


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


class _OffloadedToHost:
    """MemTracker's device key for the host copies of offloaded activations
    (:data:`OFFLOADED_HOST`): host memory like a CPU tensor's (``type``), kept apart from the step's
    device and from the CPU tensors a CUDA step keeps anyway (a torch optimizer's step counts)."""

    type, index = "cpu", None

    def __repr__(self) -> str:
        return "host (offloaded activations)"

    def __deepcopy__(self, memo):
        return self


OFFLOADED_HOST = _OffloadedToHost()


@contextlib.contextmanager
def storages_offloaded():
    """Inside it, a storage torch's MemTracker first sees is counted under :data:`OFFLOADED_HOST`,
    at its own size (host memory has no 512-byte blocks), not under the device it is on: the pack
    hook of activation offloading makes its host copy inside it, so a step's peak splits into the
    device's categories and the host's copies (:func:`effitrain.memory.step_peak.breakdown`). Its
    private ``_WeakRefInfo.create_winfo`` is replaced for the duration, on top of any replacement
    already in place (:func:`storages_counted_as`). Fallback: counted on their device (a warning)."""
    from torch.distributed._tools import mem_tracker

    info = private("torch", mem_tracker, "_WeakRefInfo")
    if info is None or "create_winfo" not in info.__dict__:
        log.warning("torch %s: offloaded activations counted on their device", version("torch"))
        yield
        return
    saved, create = info.__dict__["create_winfo"], info.create_winfo

    def create_winfo(st, device, reftype, callback=None):
        winfo, ref = create(st, OFFLOADED_HOST, reftype, callback)
        winfo.host = True  # storages_counted_as's counting: at its size
        winfo.mem_consumed = winfo.size * winfo.element_size
        return winfo, ref

    info.create_winfo = create_winfo
    try:
        yield
    finally:
        info.create_winfo = saved


def fsdp_mem_tracker_class():
    """torch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``, a private module):
    ``MemTracker`` with FSDP2's categories (sharded and unsharded parameters and gradients, all-gather
    and reduce-scatter buffers). No fallback: the per-rank categories come from it."""
    from torch.distributed._tools import fsdp2_mem_tracker

    tracker = private("torch", fsdp2_mem_tracker, "FSDPMemTracker")
    if tracker is None:
        raise missing("torch", "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker")
    return tracker


def _collect_garbage(*_) -> None:  # a forward hook: returning the count would replace the output
    import gc

    gc.collect()


def _modules(external) -> list:
    import torch

    return [m for module in external if isinstance(module, torch.nn.Module) for m in module.modules()]


def _leaves_dead_graph(module) -> bool:
    """peft's DoRA layer computes its update ``B @ A`` with gradients and uses only its detached norm.
    With its module never imported there is none (and importing peft would cost a run a second)."""
    import sys

    if "peft.tuners.lora.dora" not in sys.modules:
        return False
    dora = dora_layer_class()
    return dora is not None and isinstance(module, dora)


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
