"""The parallel strategies as a config knows them, before anything loads: each one's name and the
combinations it refuses (torch-free: the config layer checks them, below the strategy objects of
:mod:`effitrain.train.parallel`, whose ``check`` is the function of its name here).

Each refusal was measured on this machine (torch 2.13, CPU, gloo): see docs/sharding.md.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from effitrain.config.errors import chosen, invalid
from effitrain.config.optimizers import optimizer_family
from effitrain.config.registry import uses_trainer


def shards(cfg: DictConfig) -> bool:
    """Whether ``cfg``'s strategy shards the model over the processes (``parallel=fsdp``): what a
    check below the strategy objects asks (a memory technique not built for sharded parameters)."""
    return str(cfg.get("parallel", {}).get("strategy", "ddp")) == "fsdp"


def check_ddp(cfg: DictConfig, device: str | None = None) -> None:
    """``ddp``: every process holds the whole model, so FSDP's keys keep their defaults.

    Raises:
        ConfigError: ``parallel.offload`` or ``parallel.reshard_after_forward`` set.
    """
    parallel = cfg.parallel
    if parallel.offload or not parallel.reshard_after_forward:
        key = "parallel.offload" if parallel.offload else "parallel.reshard_after_forward"
        value = parallel.offload if parallel.offload else parallel.reshard_after_forward
        raise invalid(key, value, "it is FSDP's: use parallel=fsdp, or leave it out with parallel=ddp")


def check_fsdp(cfg: DictConfig, device: str | None = None) -> None:
    """``fsdp`` against the other groups and the machine (``device``: the one checked for; None:
    this machine's).

    Raises:
        ConfigError: the Trainer backend, compile, an optimizer that cannot update DTensor
            parameters, an adapter, more processes on this machine than GPUs.
    """
    strategy = str(cfg.parallel.strategy)
    if uses_trainer(cfg):
        raise invalid(
            "parallel", strategy, "backend=trainer shards through its own fsdp arguments and builds the "
            "optimizer after wrapping, not effitrain's: use backend=accelerator"
        )  # fmt: skip
    adapter = cfg.get("adapter")
    if adapter is not None and adapter.get("_target_"):
        raise invalid(
            *chosen(cfg, "adapter"), "with parallel=fsdp an adapted model is not sharded (peft's layers under "
            "fully_shard are not built or tested): use adapter=none, or parallel=ddp"
        )  # fmt: skip
    if cfg.compile.enabled:
        raise invalid(
            "compile", "on", "with parallel=fsdp the sharded model is not compiled (compile per block after "
            "fully_shard is not built): use compile=off"
        )  # fmt: skip
    target = str(cfg.optimizer.get("_target_", ""))
    if not optimizer_family(target).on_dtensor:
        raise invalid(
            *chosen(cfg, "optimizer"), "with parallel=fsdp: its update mixes plain tensors with the sharded "
            "(DTensor) parameters; use adamw, adamw_fused or lion"
        )  # fmt: skip
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = _cuda_devices() if device in (None, "cuda") else 0
    if gpus and processes > gpus:
        raise invalid(
            "parallel", strategy, f"{processes} processes on this machine and {gpus} GPUs: the device mesh "
            "needs a GPU per process (nccl); launch at most one process per GPU"
        )  # fmt: skip


# parallel.strategy -> its checks: the one list of the strategies' names (the schema's choices are
# its keys; each object of effitrain.train.parallel answers check() with its function here)
CHECKS = {"ddp": check_ddp, "fsdp": check_fsdp}


def check_parallel(cfg: DictConfig, device: str | None = None) -> None:
    """``parallel`` against the other groups and the machine: the chosen strategy's checks.

    Raises:
        ConfigError: what :func:`check_ddp` or :func:`check_fsdp` refuses.
    """
    CHECKS[str(cfg.parallel.strategy)](cfg, device)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
