"""FSDP2 sharding (``parallel=fsdp``): ``fully_shard`` per transformer block, then the root.

    torchrun --nproc_per_node 2 train.py parallel=fsdp        # gloo on CPU, nccl on GPUs

Each parameter becomes a ``DTensor`` whose local part is this rank's rows: dim 0 padded to a
multiple of the world size, then split evenly. A block's full weights exist only while it runs
(all-gathered before its forward and again before its backward with ``reshard_after_forward``,
ZeRO-3; kept from forward to backward without it, ZeRO-2); its gradients are reduce-scattered,
so each rank holds its rows of gradients and optimizer state. The optimizer must be built after
:func:`shard`: the parameters it holds are the sharded ones.

The memory prediction runs :func:`shard` on fake tensors with a fake process group, so nothing
here reads a tensor's values.
"""

from __future__ import annotations

import contextlib

import torch

from effitrain.train.distributed import close_group_at_exit
from effitrain.util.compat import no_split_modules

# precision.mixed_precision -> the dtype FSDP2 gathers the weights in for forward and backward
PARAM_DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_policy(precision: str):
    """FSDP2's policy for ``precision.mixed_precision`` (``no``, ``bf16``, ``fp16``): the sharded
    weights, gradients and optimizer state stay fp32; the gathered weights are cast to the low
    precision for compute, and gradients are reduced in fp32, as torchtitan does."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = PARAM_DTYPES[str(precision)]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def offload_policy(offload: bool):
    """CPU offload: FSDP2 offloads the sharded parameters, their gradients and so the optimizer
    state (built on those parameters) together; there is no policy for one of them alone."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy() if offload else OffloadPolicy()


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: the modules of the classes transformers' ``_no_split_modules``
    names (the units it never splits across devices), outermost only, in model order. A model that
    names none (DistilBERT) has its blocks found as the repeated layers: the children of its longest
    ``ModuleList`` whose children are all of one class (:func:`repeated_layers`).

    Raises:
        ValueError: the model names no such classes and repeats no layer, or holds none of them.
    """
    names = set(no_split_modules(model))
    if not names:
        blocks = repeated_layers(model)
        if not blocks:
            raise ValueError(
                f"{type(model).__name__} names no transformer blocks (_no_split_modules is empty) and "
                "repeats no layer (no ModuleList of one class)"
            )
        return blocks
    blocks, inside = [], set()
    for name, module in model.named_modules():
        if type(module).__name__ in names and not any(name.startswith(f"{outer}.") for outer in inside):
            blocks.append(module)
            inside.add(name)
    if not blocks:
        raise ValueError(f"{type(model).__name__} holds none of its _no_split_modules {sorted(names)}")
    return blocks


def repeated_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the model's longest ``ModuleList`` (two or more) whose children are all of one
    class: a transformer's stack of layers, found without its name; [] where there is none."""
    stacks = [
        list(module)
        for module in model.modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1
    ]
    return max(stacks, key=len, default=[])


def shard(model: torch.nn.Module, parallel_cfg, precision: str, mesh) -> torch.nn.Module:
    """``model`` sharded in place over ``mesh`` (a 1-D ``DeviceMesh``): each transformer block,
    then the root (embeddings, head, final norm), so one block's weights are gathered at a time.

    ``parallel_cfg``: the ``parallel`` node (``reshard_after_forward``, ``offload``);
    ``precision``: ``precision.mixed_precision``. Returns ``model`` (now an ``FSDPModule``).
    """
    from torch.distributed.fsdp import fully_shard

    settings = {
        "mesh": mesh,
        "reshard_after_forward": bool(parallel_cfg.reshard_after_forward),
        "mp_policy": mixed_precision_policy(precision),
        "offload_policy": offload_policy(bool(parallel_cfg.offload)),
    }
    for block in transformer_blocks(model):
        fully_shard(block, **settings)
    fully_shard(model, **settings)
    return model


def device_mesh(device: torch.device):
    """The 1-D mesh of every process, on ``device``'s type: named explicitly, as with GPUs visible
    the default mesh is CUDA even for a CPU run (pytorch #132471). One process without a launcher
    gets a group of its own: the model is "sharded" over one rank (whole, as with ``ddp``, and CPU
    offload still applies), so one GPU can run what a rank of a larger world runs."""
    from torch.distributed.device_mesh import init_device_mesh

    if not torch.distributed.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(
            backend, store=torch.distributed.HashStore(), rank=0, world_size=1
        )
        close_group_at_exit()
    return init_device_mesh(device.type, (torch.distributed.get_world_size(),))


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync_off(model):
    """FSDP2's ``no_sync``: the micro-batch's gradients accumulate unsharded on each rank and are
    reduce-scattered with the window's last."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_value(tensor):
    """A ``DTensor``'s whole value (clipping over sharded gradients returns the norm as one), else
    ``tensor`` itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
