"""Checkpoints every ``checkpoint_every`` optimizer steps and at the end; exact resume from the newest.

A checkpoint is a folder ``<run>/checkpoints/step-<N>``:

    model.safetensors    weights of the uncompiled module (no ``_orig_mod.`` prefix)
    adapter_model.safetensors, adapter_config.json
                         instead, with an adapter (adapter=lora|dora|qlora): peft's own files, the
                         adapter and the head it trains; the frozen base is rebuilt as the run built it
    optimizer.pt         ``optimizer.state_dict()``, 8-bit state included
    *.distcp, .metadata  instead of the two above, under ``parallel=fsdp``: weights and optimizer
                         state as ``torch.distributed.checkpoint`` writes them, each rank its own shards
    scheduler.pt         learning-rate schedule
    rng_state.pth        python, numpy, torch CPU (and CUDA) generators; ``rng_state_<rank>.pth`` per process
    trainer_state.json   Trainer backend only: lets ``Trainer.train(resume_from_checkpoint=)`` skip data
    effitrain.json       step, data position, meter counts, config and file sizes; written last

File names are the Trainer's, so the Trainer backend resumes through the Trainer's own loading
(safetensors and ``torch.load(weights_only=True)``) and its data skipping. Loading never unpickles
arbitrary objects: everything that is not safetensors is read with ``weights_only=True``, and a
sharded checkpoint's files through :mod:`effitrain.train.sharded_checkpoint`'s restricted reader.

A folder is assembled under a hidden temporary name, every file fsynced, then renamed in one
step: a run killed at any moment leaves the previous checkpoints whole, and a folder without a
matching ``effitrain.json`` is never resumed from.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig

from effitrain.config.record import first_difference, trajectory_config
from effitrain.train.distributed import barrier, rank, world_size
from effitrain.train.parallel import strategy_of
from effitrain.train.resume_point import (
    FOLDER,
    FORMAT,
    META,
    Position,
    ResumePoint,
    list_checkpoints,
    position,
    read_meta,
)
from effitrain.train.rng import rng_file_name, rng_state
from effitrain.util.atomic import publish, sha256

log = logging.getLogger(__name__)


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every thread)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)  # no /proc (not Linux): the one way left, for an instant
    os.umask(umask)
    return umask


class CheckpointNotWritten(RuntimeError):
    """A checkpoint could not be written (a full disk); nothing of it is left behind."""


class Checkpointer:
    """Saves a run's training state on schedule and restores it on resume.

    Holds the uncompiled model, the optimizer and scheduler that the backend steps; the run's shared
    code calls :meth:`restore` before the backend's loop and :meth:`after_step` after each optimizer
    step whose loss was found finite.
    """

    def __init__(self, cfg: DictConfig, output_dir: Path, model, optimizer, scheduler, meter, num_steps: int,
                 batches_per_epoch: int, resume: ResumePoint | None = None):  # fmt: skip
        self.cfg = cfg
        self.root = Path(output_dir) / FOLDER
        self.every = cfg.get("checkpoint_every")
        self.keep = cfg.get("checkpoint_keep", 2)
        self.model, self.optimizer, self.scheduler, self.meter = model, optimizer, scheduler, meter
        self.num_steps = num_steps
        self.batches_per_epoch = batches_per_epoch
        self.resume = resume
        self.record = trajectory_config(cfg)  # what a checkpoint of this run records as its config
        self.written: set[Path] = set()  # the folders this process published
        self.named: set[Path] = set()  # others in the folder, said once

    # -- saving -------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.num_steps)

    def after_step(self, step: int, trainer_state=None) -> Path | None:
        """Save when ``step`` is due. Call after the step's loss was checked, so a diverged
        state is never saved. ``trainer_state`` (a TrainerState) is written for the Trainer's resume."""
        if not self.due(step):
            return None
        return self.save(step, trainer_state)

    def save(self, step: int, trainer_state=None) -> Path:
        target = self.root / f"step-{step:08d}"
        tmp = self.root / f".partial-step-{step:08d}"
        is_main = rank() == 0
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        try:
            torch.save(rng_state(), tmp / rng_file_name())
            strategy_of(self.cfg).save(self.model, self.optimizer, tmp)  # weights and optimizer state
            barrier()
            if is_main:
                self._write(step, tmp, target, trainer_state)
        except (OSError, RuntimeError) as error:
            # a full disk: the partial files would keep it full, and torch's own message is a
            # C++ assertion ("enforce fail at inline_container.cc")
            if not isinstance(error, OSError) and "inline_container" not in str(error):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            reason = error.strerror if isinstance(error, OSError) and error.strerror else "a write failed"
            free = shutil.disk_usage(self.root).free
            raise CheckpointNotWritten(
                f"the checkpoint of step {step} could not be written in {self.root} ({reason}; "
                f"{free} bytes free): its partial files were removed"
            ) from error
        barrier()
        return target

    def _write(self, step: int, tmp: Path, target: Path, trainer_state) -> None:
        for weights in tmp.glob("*.safetensors"):
            # safetensors writes 0600: the weights follow the umask as every other result file
            os.chmod(weights, 0o666 & ~_umask())
        torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
        if trainer_state is not None:
            trainer_state.save_to_json(str(tmp / "trainer_state.json"))
        at = position(step, self.batches_per_epoch, self.cfg.gradient_accumulation_steps)
        meta = {
            "format": FORMAT,
            "step": step,
            "epoch": at.epoch,
            "batches_in_epoch": at.batches,
            "num_steps": self.num_steps,
            "world_size": world_size(),
            "meter": {
                "samples": self.meter.samples,
                "tokens": self.meter.tokens,
                "last_loss": self.meter.last_loss,
                "loss_total": self.meter.loss_total,
                "best_eval": self.meter.best_eval,
            },
            "config": trajectory_config(self.cfg),
            "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())},
            # verified before resuming: a flipped byte must not resume silently
            "sha256": {p.name: sha256(p) for p in sorted(tmp.iterdir())},
        }
        with open(tmp / META, "w") as handle:
            json.dump(meta, handle, indent=2, sort_keys=True, default=str)
            handle.flush()
            os.fsync(handle.fileno())
        # a checkpoint of the same step from an earlier attempt is replaced
        publish(tmp, target, replace_folder=True)
        self.written.add(target)
        self.prune()

    def prune(self) -> None:
        """Keep this run's newest ``checkpoint_keep`` checkpoints; remove leftovers of interrupted writes.

        Only what this run wrote is removed: the folders this process published, and the complete
        checkpoints of this run's earlier attempts (same config and number of processes, so the ones
        ``resume=auto`` continues). Any other ``step-*`` folder (damaged, another run's, a link) is left
        alone and named once: numbered above this run's steps, it would otherwise keep its place and
        push this run's own checkpoints out."""
        for stale in self.root.glob(".partial-step-*"):
            if not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
        ours = []
        for _, folder in list_checkpoints(self.root.parent):
            if self._is_ours(folder):
                ours.append(folder)
            elif folder not in self.named:
                self.named.add(folder)
                why = f"left alone by pruning: {folder} is not a complete checkpoint of this run"
                log.warning(why)
                print(f"effitrain: warning: {why}", file=sys.stderr, flush=True)
        for folder in ours[: max(len(ours) - self.keep, 0)]:
            shutil.rmtree(folder, ignore_errors=True)
            self.written.discard(folder)

    def _is_ours(self, folder: Path) -> bool:
        if folder.is_symlink():
            return False
        if folder in self.written:
            return True
        meta = read_meta(folder)  # sizes, not checksums: cheap at every save
        return (
            meta is not None
            and meta.get("world_size") == world_size()
            and first_difference(self.record, meta.get("config") or {}) is None
        )

    # -- resuming -----------------------------------------------------------------------------

    def restore(self, weights: bool = True) -> Position:
        """Load the resume point (if any) into the model, optimizer, scheduler and meter; where
        training stands.

        ``weights=False`` restores only effitrain's own counts, for a backend (the Trainer) that
        loads model, optimizer, scheduler and generators itself. The generators are restored once
        the consumed micro-batches were skipped (:func:`effitrain.train.step.epoch_batches`).
        """
        if self.resume is None:
            return Position(0, 0, 0)
        folder, meta = self.resume.folder, self.resume.meta
        if weights:
            strategy_of(self.cfg).load(self.model, self.optimizer, folder)
            self.scheduler.load_state_dict(
                torch.load(folder / "scheduler.pt", map_location="cpu", weights_only=True)
            )
        self.meter.restore(meta["step"], **meta["meter"])
        at = self.resume.position(self.batches_per_epoch, self.cfg.gradient_accumulation_steps)
        log.info(
            "resumed from %s: step %d, epoch %d, %d micro-batches in", folder, at.step, at.epoch, at.batches
        )
        return at
