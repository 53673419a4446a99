"""Every generator a training step may draw from, saved with a checkpoint and restored on resume, in
the Trainer's layout (``rng_state.pth``, ``rng_state_<rank>.pth`` per process)."""

from __future__ import annotations

import random

import torch

from effitrain.train.distributed import rank, world_size


def rng_file_name() -> str:
    return f"rng_state_{rank()}.pth" if world_size() > 1 else "rng_state.pth"


def rng_state() -> dict:
    """Every generator a training step may draw from, in the Trainer's layout.

    numpy's key array is stored as a list of ints so that ``weights_only`` loading needs no numpy globals.
    """
    import numpy as np

    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, key.tolist(), pos, has_gauss, gauss),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = (
            torch.cuda.random.get_rng_state_all() if world_size() > 1 else torch.cuda.random.get_rng_state()
        )
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        if isinstance(state["cuda"], list):
            torch.cuda.random.set_rng_state_all(state["cuda"])
        else:
            torch.cuda.random.set_rng_state(state["cuda"])
