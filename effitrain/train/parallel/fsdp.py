"""``parallel=fsdp``: FSDP2 sharding, each process holding its rows of every weight, gradient and
optimizer state (the mechanics: :mod:`effitrain.train.sharding`; the checkpoint:
:mod:`effitrain.train.sharded_checkpoint`; one rank's memory predicted: :mod:`effitrain.memory.sharded`).

    torchrun --nproc_per_node 2 train.py parallel=fsdp        # gloo on CPU, nccl on GPUs
"""

from __future__ import annotations

from pathlib import Path

from effitrain.config.optimizers import optimizer_family
from effitrain.config.parallel import check_fsdp
from effitrain.train.distributed import world_size
from effitrain.train.parallel.ddp import batches_per_process
from effitrain.train.sharded_checkpoint import load_sharded, save_sharded
from effitrain.train.sharding import device_mesh, gradient_sync_off, shard


class FSDP:
    name = "fsdp"
    shards = True
    check = staticmethod(check_fsdp)

    def apply(self, model, cfg, device, say=lambda line: None):
        """``model`` sharded over every process (a group of one without a launcher: nothing split,
        offload applies), before the optimizer: it must hold the sharded parameters."""
        if world_size() == 1:
            say("parallel=fsdp in one process: sharded over a group of one (nothing split, offload applies)")
        return self.apply_on_mesh(model, cfg, device_mesh(device))

    def apply_on_mesh(self, model, cfg, mesh):
        return shard(model, cfg.parallel, cfg.precision.mixed_precision, mesh)

    def batches_per_process(self, batches: int, processes: int) -> int:
        """Data parallel too: each process trains on a batch of its own, as under ``ddp``."""
        return batches_per_process(batches, processes)

    def save(self, model, optimizer, folder: Path) -> None:
        """Each rank writes its own shards (``torch.distributed.checkpoint``)."""
        save_sharded(model, optimizer, folder)

    def load(self, model, optimizer, folder: Path) -> None:
        """Each rank reads its shards through the restricted reader: no file's content runs."""
        load_sharded(model, optimizer, folder)

    def no_sync(self, model):
        return gradient_sync_off(model)

    def replay_refusal(self, optimizer_cfg) -> str | None:
        """Training refuses these optimizers (:func:`check_fsdp`): no prediction for a run that cannot be."""
        target = str(optimizer_cfg.get("_target_", ""))
        if not optimizer_family(target).on_dtensor:
            return (
                f"optimizer._target_={target!r} is invalid with parallel=fsdp: its update mixes plain tensors "
                "with the sharded (DTensor) parameters"
            )
        return None
