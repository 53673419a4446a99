"""``parallel=ddp`` (the default): every process holds the whole model and trains on a batch of its
own; the backend averages the gradients (accelerate's DDP wrapper, or the Trainer's).

    accelerate launch --num_processes 2 train.py          # GPUs
    torchrun --nproc_per_node 2 train.py                  # CPU (gloo)

Its checkpoint is rank 0's whole model: ``model.safetensors`` (or peft's adapter files) and
``optimizer.pt``, the files the Trainer's own resume reads.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from effitrain.config.parallel import check_ddp
from effitrain.train.adapters.files import load_adapter, save_adapter
from effitrain.train.distributed import rank


def batches_per_process(batches: int, processes: int) -> int:
    """accelerate shards batches over processes: each process sees ``ceil(batches / processes)``
    of them, whatever each process holds of the model."""
    return math.ceil(batches / processes)


class DDP:
    name = "ddp"
    shards = False
    check = staticmethod(check_ddp)

    def apply(self, model, cfg, device, say=lambda line: None):
        """Nothing to do here: the backend wraps the model for gradient averaging."""
        return model

    def batches_per_process(self, batches: int, processes: int) -> int:
        return batches_per_process(batches, processes)

    def save(self, model, optimizer, folder: Path) -> None:
        """Rank 0 writes the whole model (every rank holds the same) and the optimizer's state."""
        from safetensors.torch import save_model

        if rank() != 0:
            return
        if not save_adapter(model, folder):
            save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")

    def load(self, model, optimizer, folder: Path) -> None:
        """Every rank reads the whole model onto its device; nothing but safetensors and
        ``weights_only`` pickles is read."""
        from safetensors.torch import load_model

        device = next(model.parameters()).device
        if not load_adapter(model, folder, device):
            load_model(model, str(folder / "model.safetensors"), strict=True, device=str(device))
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True))
