"""torch's other private APIs effitrain uses: fake tensors and a fake process group (the
prediction's), a dispatch mode, pytree, the attention kernels' ops, Adam's step dtype, dynamo's
compile time, the normalization base class.
"""

from __future__ import annotations

import contextlib
import functools
import math

from effitrain.util.compat.guard import missing, private


def fake_process_group(rank: int, world_size: int) -> None:
    """The default process group as ``rank`` of ``world_size`` processes that are not there: torch's
    ``fake`` backend (``torch.testing._internal.distributed.fake_pg``, a testing module), whose
    collectives return at once and move nothing. No fallback: the per-rank prediction needs it."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed import fake_pg
    except ImportError:
        raise missing("torch", "torch.testing._internal.distributed.fake_pg") from None
    store = private("torch", fake_pg, "FakeStore")
    if store is None:
        raise missing("torch", "torch.testing._internal.distributed.fake_pg.FakeStore")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=store())


def fake_tensor_mode():
    """A ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): tensors with shapes and no memory.
    No fallback: the step prediction cannot run without it."""
    from torch._subclasses import fake_tensor

    mode = private("torch", fake_tensor, "FakeTensorMode")
    if mode is None:
        raise missing("torch", "torch._subclasses.fake_tensor.FakeTensorMode")
    return mode()


def outside_fake_mode():
    """A context in which real (or ``meta``) tensors are made even under a ``FakeTensorMode``
    (``torch._subclasses.fake_tensor.unset_fake_temporarily``): what a replay builds to inspect,
    not to replay (transformers' 4-bit quantizer on ``meta``). No fallback."""
    from torch._subclasses import fake_tensor

    unset = private("torch", fake_tensor, "unset_fake_temporarily")
    if unset is None:
        raise missing("torch", "torch._subclasses.fake_tensor.unset_fake_temporarily")
    return unset()


def is_fake(tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (``torch._subclasses.fake_tensor.FakeTensor``): a replay's,
    not a run's. Fallback: a tensor of a class named so."""
    from torch._subclasses import fake_tensor

    cls = private("torch", fake_tensor, "FakeTensor")
    return isinstance(tensor, cls) if cls is not None else type(tensor).__name__ == "FakeTensor"


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
        raise missing("torch", "TorchDispatchMode and DataDependentOutputException")
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
        raise missing("torch", "torch.utils._pytree.tree_map")
    return mapped(fn, tree)


# CUDA's fused attention kernels, each its own aten op with a meta function (underscore names)
SDPA_KERNEL_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention")


def sdpa_kernel_op(name: str):
    """The aten op of one of :data:`SDPA_KERNEL_OPS`. No fallback: the CUDA replay of attention
    runs the kernel's own op, so that autograd keeps what its backward keeps."""
    import torch

    op = private("torch", torch.ops.aten, name)
    if op is None:
        raise missing("torch", f"torch.ops.aten.{name}")
    return op


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process so far (dynamo's own timing,
    ``torch._dynamo.utils.compilation_time_metrics``). Fallback: NaN (unknown), not 0."""
    from torch._dynamo import utils

    metrics = private("torch", utils, "compilation_time_metrics")
    if metrics is None:
        return math.nan
    return float(sum(metrics.get("_compile.compile_inner", [])))


@functools.cache
def batch_norm_classes() -> tuple[type, ...]:
    """The classes of torch's batch normalization layers: their common base
    (``torch.nn.modules.batchnorm._BatchNorm``, which a user's own batch norm may subclass too).
    Fallback: torch's public batch norm classes."""
    import torch
    from torch.nn.modules import batchnorm

    base = private("torch", batchnorm, "_BatchNorm")
    if base is not None:
        return (base,)
    return (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


@contextlib.contextmanager
def dynamo_left_unimported():
    """Optimizers built inside without importing ``torch._dynamo`` (2 to 3 s of a check's 5):
    torch's ``_disable_dynamo`` decorator imports dynamo at the first call of
    ``Optimizer.add_param_group`` to wrap it, which an optimizer built on a dummy parameter to check
    its arguments, then dropped, never needs. The decorator's cache (``__dynamo_disable`` on the
    function) holds the function itself meanwhile and is removed after, so a later call wraps it as
    torch does. Where dynamo is imported already, or the decorator is laid out otherwise (no
    ``__wrapped__``), nothing changes."""
    import sys

    import torch

    function = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if "torch._dynamo" in sys.modules or function is None or hasattr(function, "__dynamo_disable"):
        yield
        return
    setattr(function, "__dynamo_disable", function)
    try:
        yield
    finally:
        if getattr(function, "__dynamo_disable", None) is function:
            delattr(function, "__dynamo_disable")


def function_modes() -> list:
    """The torch-function modes active now, outermost first
    (``torch.overrides._get_current_function_mode_stack``): what a recomputation in backward
    re-enters, as checkpoint restores autocast (the CUDA replay's emulated autocast is such a mode).
    Fallback: none (the recomputation then runs outside them)."""
    import torch

    stack = private("torch", torch.overrides, "_get_current_function_mode_stack")
    return list(stack()) if stack is not None else []


def on_fake_or_meta(tensor) -> bool:
    """Whether ``tensor`` holds no data: on ``meta``, or a fake tensor (:func:`is_fake`)."""
    return tensor.device.type == "meta" or is_fake(tensor)
