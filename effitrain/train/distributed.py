"""Distributed primitives: the process group, this process's rank, sums over processes.

Everything here is a no-op in a single process, so callers never branch on data parallelism.
"""

from __future__ import annotations

import atexit
import functools

import torch


def process_state():
    """accelerate's process-wide state; on a machine without CUDA, several launched processes
    (``torchrun``) form a gloo group on the CPU, which accelerate does only when told ``cpu``."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    close_group_at_exit()
    return state


@functools.cache
def close_group_at_exit() -> None:
    """Destroy the process group, if there is one, when the interpreter exits, while it is still whole:
    a gloo group left to the interpreter's end aborts it now and then ("terminate called without an
    active exception", its worker threads torn down unjoined; pytorch PR 179291 would do the same)."""
    atexit.register(_destroy_group)


def _destroy_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def launched_world_size() -> int:
    """The processes the launcher started (torchrun's and accelerate's ``WORLD_SIZE``), known
    before this process joins their group: what the front door's checks compare against."""
    import os

    return world_size() if torch.distributed.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


def all_reduce_sum(values: list[float], device) -> list[float]:
    """Sum scalars over processes (a no-op in a single process)."""
    if world_size() == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor)
    return tensor.tolist()
