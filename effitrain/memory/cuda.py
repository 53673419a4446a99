"""What a CUDA device keeps during a training step, modeled on CPU fake tensors.

The step peak is predicted by replaying one step on fake tensors (:func:`effitrain.memory.replay.trace_step`).
Run as it is, that replay takes the CPU's kernels, and three of them hold other tensors than CUDA's do:

* dropout: on CPU ``at::dropout`` multiplies by a float noise tensor and keeps it for backward
  (4 bytes per element); on CUDA it is ``native_dropout``, which keeps a bool mask (1 byte);
* ``scaled_dot_product_attention``: in training on CPU (dropout > 0) it takes the math path, which
  materializes the scores, their softmax and the dropout's noise; on CUDA it picks the flash or the
  memory-efficient kernel, which keep the inputs, the output, a logsumexp and the RNG's seed and
  offset (see their derivatives in PyTorch's ``derivatives.yaml`` and the shapes in its
  ``_meta_registrations.py``);
* the optimizers: on CUDA tensors torch's optimizers default to their ``foreach`` implementation
  (one temporary as large as a parameter group, where the CPU's per-tensor loop needs one as large
  as a parameter), and ``clip_grad_norm_`` to ``_foreach_norm``.

:func:`cuda_kernels`, around the replayed step, sends dropout and attention to those ops (which run
on fake CPU tensors through their meta functions, so autograd saves exactly what the CUDA op's
backward needs); :class:`CudaAutocast` applies CUDA's autocast cast lists for ``bf16``/``fp16``. Fake tensors on a ``cuda`` device cannot be used instead: this CPU build has no
CUDA device guard, and autograd aborts the process on them.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from effitrain.util.compat import sdpa_kernel_op, tree_map

# The order torch tries SDPA's kernels on CUDA (torch._C._get_sdp_priority_order(): flash,
# memory-efficient, math; cuDNN after math, so never chosen by default).
FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
_CPU_DROPOUT = F.dropout
# The CUDA caching allocator's smallest block (c10's kMinBlockSize): every CUDA storage takes a
# whole number of them, and MemTracker counts a CUDA storage so (its _PYTORCH_MIN_ALLOCATE).
CUDA_BLOCK = 512


def in_blocks(nbytes: int, block: int = CUDA_BLOCK) -> int:
    return -(-nbytes // block) * block


def _steps_on_host(optimizer) -> bool:
    """torch's optimizers keep their step counts on the CPU unless fused or capturable
    (``_init_group``: ``torch.tensor(0.0)``), and the scalars their update derives from them."""
    return type(optimizer).__module__.startswith("torch.optim") and not any(
        group.get("fused") or group.get("capturable") for group in optimizer.param_groups
    )


@contextlib.contextmanager
def allocator_blocks():
    """Inside it, the step tracker counts each storage as a CUDA run's MemTracker does: in whole
    512-byte blocks, except what a CUDA run keeps on the CPU, counted at its size: a torch
    optimizer's step counts and the scalars made during its step, and the RNG seed and offset
    the memory-efficient attention returns (:func:`_rng_state_on_host`)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.utils.weak import WeakIdKeyDictionary

    from effitrain.util.compat import storages_counted_as

    host = WeakIdKeyDictionary()
    stepping = []

    def before(optimizer, args, kwargs):
        stepping.append(_steps_on_host(optimizer))

    def after(optimizer, args, kwargs):
        if stepping.pop():
            for state in optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    host[state["step"].untyped_storage()] = True

    def is_host(storage, device) -> bool:
        stepping_on_host = bool(stepping) and stepping[-1] and storage.size() <= 8
        return storage in host or stepping_on_host or (_attention_rng and storage.size() <= 16)

    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        with storages_counted_as(in_blocks, is_host):
            yield
    finally:
        for handle in handles:
            handle.remove()


# What the CUDA allocator holds beside the step's tensors, which no replay of them shows: cuBLAS's
# workspace, one per cuBLAS handle, and torch keeps a handle per thread, so the step's thread and
# autograd's backward thread hold one each; torch sizes it by compute capability (":4096:8", 32 MiB,
# from 9.0, the Hopper GPUs this profile replays: cuBLAS's recommended size for them). On an H200,
# max_memory_allocated was 64.4 MiB or more above the predicted run peak, and 1.2 to 16.2 MiB with
# CUBLAS_WORKSPACE_CONFIG=:0:0 (docs/results.md, "On a GPU").
CUBLAS_WORKSPACES_BYTES = 2 * 32 * 2**20


def sdpa_kernel(query, key, value, attn_mask, dropout_p: float, is_causal: bool, enable_gqa: bool,
                compute_capability: tuple[int, int] = (9, 0)) -> str:  # fmt: skip
    """The kernel ``scaled_dot_product_attention`` picks on a CUDA GPU of ``compute_capability`` for
    these (dense, 4-D) inputs, as ``sdp_utils.cpp`` decides: flash needs fp16/bf16, no mask, a head
    size of at most 256 and sm80 or newer; the memory-efficient kernel takes fp32 too, and masks,
    with a head size that is a multiple of 8 (fp16/bf16) or 4 (fp32); else math."""
    head, head_v = query.shape[-1], value.shape[-1]
    low_precision = query.dtype in (torch.float16, torch.bfloat16)
    same_dtype = query.dtype == key.dtype == value.dtype
    dense = query.dim() == key.dim() == value.dim() == 4
    if (
        dense and same_dtype and low_precision and attn_mask is None and head == head_v and head <= 256
        and compute_capability >= (8, 0) and not (enable_gqa and query.shape[1] % key.shape[1])
        and not (is_causal and query.shape[-2] != key.shape[-2])
    ):  # fmt: skip
        return FLASH
    alignment = 8 if low_precision else 4
    if (
        dense and same_dtype and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and head % alignment == 0 and head_v % alignment == 0 and compute_capability >= (5, 0)
        and not enable_gqa
    ):  # fmt: skip
        return EFFICIENT
    return MATH


def _additive_mask(attn_mask, dtype):
    """SDPA's ``convert_boolean_attn_mask``: a bool mask becomes 0 / -inf in the query's dtype."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.where(attn_mask.logical_not(), -math.inf, 0.0).to(dtype)


def _pad_last(tensor, multiple: int):
    """``pad_last_dim``/``pad_bias``: a copy padded to a multiple of ``multiple``, sliced back."""
    size = tensor.shape[-1]
    if size % multiple == 0:
        return tensor
    padded = F.pad(tensor, (0, multiple - size % multiple))
    return padded[..., :size]


def _math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """``_scaled_dot_product_attention_math`` with CUDA's dropout (a bool mask)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    if enable_gqa:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    root = math.sqrt(scale)
    scores = (query * root) @ (key.transpose(-2, -1) * root)
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
        attn_mask = causal if attn_mask is None else attn_mask & causal
    mask = _additive_mask(attn_mask, scores.dtype)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, -1)
    if dropout_p > 0.0:
        probs = torch.ops.aten.native_dropout(probs, dropout_p, True)[0]
    return probs @ value


_attention_rng: list = []  # non-empty while the memory-efficient attention runs (allocator_blocks reads it)


@contextlib.contextmanager
def _rng_state_on_host():
    """Around the memory-efficient attention op: its outputs of at most 16 bytes are its RNG seed
    and offset, which a CUDA run keeps on the CPU (its meta function makes them on ``meta``; every
    other output holds rows of the batch). The flash kernel's stay on the GPU (torch's "BC breaking
    change to flash seed/offset"), as an H200 counted them."""
    _attention_rng.append(True)
    try:
        yield
    finally:
        _attention_rng.pop()


def cuda_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``scaled_dot_product_attention`` as CUDA runs it, on CPU fake tensors: the chosen kernel's
    own aten op, so autograd keeps what that kernel's backward needs (q, k, v, out, logsumexp,
    seed and offset; a padded copy of the mask for the memory-efficient kernel)."""
    if _autocast_dtype:  # SDPA is on CUDA's lower-precision autocast list
        query, key, value = (
            t.to(_autocast_dtype[-1]) if t.is_floating_point() else t for t in (query, key, value)
        )
    kernel = sdpa_kernel(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if kernel == FLASH:
        size = query.shape[-1]
        q, k, v = (_pad_last(t, 8) for t in (query, key, value))
        out = sdpa_kernel_op("_scaled_dot_product_flash_attention")(
            q, k, v, dropout_p, is_causal, False, scale=scale
        )[0]
        return out if out.shape[-1] == size else out[..., :size]
    if kernel == EFFICIENT:
        mask = _additive_mask(attn_mask, query.dtype)
        if mask is not None:
            mask = _pad_last(mask, 16).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        with _rng_state_on_host():
            return sdpa_kernel_op("_scaled_dot_product_efficient_attention")(
                query, key, value, mask, needs_grad, dropout_p, is_causal, scale=scale
            )[0]
    return _math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as CUDA runs it: ``native_dropout``, which keeps a bool mask for backward."""
    if not training or p == 0.0 or p >= 1.0 or input.numel() == 0:
        return _CPU_DROPOUT(input, p, training, inplace)
    out = torch.ops.aten.native_dropout(input, p, True)[0]  # (output, bool mask); backward keeps the mask
    return input.copy_(out) if inplace else out


@contextlib.contextmanager
def cuda_kernels():
    """Inside it, dropout and attention run the ops CUDA would run, on any (fake) tensor, and
    storages are counted in the allocator's blocks (:func:`allocator_blocks`); with
    ``activation_offloading`` its saved tensors go to the host as a GPU step's do
    (:func:`effitrain.config.techniques.offload_hooks.copies_forced`).

    ``torch.nn.functional.dropout`` and ``scaled_dot_product_attention`` are replaced for the
    duration, not intercepted by a ``TorchFunctionMode``: a mode is set aside while it handles a
    call, and ``loss.backward()`` is such a call, so the layers gradient checkpointing recomputes in
    backward would run the CPU's kernels again. Code that imported either function by name before
    (``from torch.nn.functional import dropout``) keeps the CPU's.
    """
    from effitrain.config.techniques.offload_hooks import copies_forced

    originals = F.dropout, F.scaled_dot_product_attention
    F.dropout, F.scaled_dot_product_attention = cuda_dropout, cuda_sdpa
    try:
        with allocator_blocks(), copies_forced():  # the fake CPU tensors are the device's: offloaded
            yield
    finally:
        F.dropout, F.scaled_dot_product_attention = originals


def foreach_by_default(optimizer) -> None:
    """What torch picks for CUDA tensors: a torch optimizer left to its default (``foreach=None``,
    not fused) takes its foreach implementation."""
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


# CUDA's autocast cast lists (aten/src/ATen/autocast_mode.cpp, the CUDA registrations), by the
# Python functions that reach those ops. CPU's lists differ: on CPU layer_norm, softmax and the
# pointwise fp32 ops run in whatever dtype they are given.
_LOWER = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "addmv",
          "mv", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
          "prelu", "einsum", "chain_matmul", "multi_head_attention_forward", "scaled_dot_product_attention"}  # fmt: skip
_FP32 = {"layer_norm", "group_norm", "softmax", "log_softmax", "cross_entropy", "nll_loss", "mse_loss", "l1_loss",
         "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy_with_logits", "exp", "expm1", "log",
         "log2", "log10", "log1p", "reciprocal", "rsqrt", "pow", "softplus", "cumsum", "cumprod", "prod", "sum",
         "logsumexp", "norm", "cosine_similarity", "erfinv", "acos", "asin", "cosh", "sinh", "tan"}  # fmt: skip
_autocast_dtype: list[torch.dtype] = []  # the innermost active emulated region's dtype, for cuda_sdpa


class CudaAutocast(torch.overrides.TorchFunctionMode):
    """CUDA's autocast applied to CPU (fake) tensors: ops on CUDA's lower-precision list get their
    floating inputs cast to ``dtype`` (a weight's cast made once per region and kept, as autocast's
    cache does), ops on its fp32 list get them cast to fp32. Used as a decorator of the model's
    forward, as accelerate uses ``torch.autocast``."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, torch.Tensor] = {}

    def __enter__(self):
        _autocast_dtype.append(self.dtype)
        return super().__enter__()

    def __exit__(self, *exc):
        _autocast_dtype.pop()
        self.cache.clear()
        return super().__exit__(*exc)

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with CudaAutocast(self.dtype):
                return fn(*args, **kwargs)

        return wrapped

    def _cast(self, value, dtype):
        if not (torch.is_tensor(value) and value.is_floating_point()) or value.dtype in (
            dtype,
            torch.float64,
        ):
            return value
        if value.is_leaf and value.requires_grad:  # a weight: cast once per region
            cached = self.cache.get(id(value))
            if cached is None:
                cached = self.cache[id(value)] = value.to(dtype)
            return cached
        return value.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        dtype = self.dtype if name in _LOWER else torch.float32 if name in _FP32 else None
        if dtype is not None:
            cast = functools.partial(self._cast, dtype=dtype)
            args = tree_map(cast, args)
            kwargs = tree_map(cast, kwargs)
        return func(*args, **kwargs)


def autocast_like(device: str, dtype: torch.dtype):
    """The autocast a run on ``device`` applies to its forward, for a replay on CPU tensors."""
    if device == "cuda":
        return CudaAutocast(dtype)
    return torch.autocast(device_type="cpu", dtype=dtype)
