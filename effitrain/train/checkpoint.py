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
import math
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from effitrain.config.errors import invalid
from effitrain.train.adapters.files import load_adapter, save_adapter
from effitrain.train.distributed import barrier, launched_world_size, rank, world_size
from effitrain.train.sharded_checkpoint import METADATA, load_sharded, refusal, save_sharded
from effitrain.train.sharding import is_sharded
from effitrain.util.atomic import publish, sha256

log = logging.getLogger(__name__)

FOLDER = "checkpoints"
META = "effitrain.json"
FORMAT = 1
_NAME = re.compile(r"^step-(\d+)$")


@dataclass
class Position:
    """Where training stands after ``step`` optimizer steps: epoch and micro-batches consumed in it."""

    step: int
    epoch: int
    batches: int


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


def position(step: int, batches_per_epoch: int, accumulation: int) -> Position:
    """Every optimizer step but an epoch's last takes ``accumulation`` micro-batches.

    A step that ends an epoch maps to the start of the next one, as the Trainer counts.
    """
    steps_per_epoch = math.ceil(batches_per_epoch / accumulation)
    epoch, steps_done = divmod(step, steps_per_epoch)
    return Position(step, epoch, steps_done * accumulation)


def first_difference(now: dict, then: dict) -> tuple[str, object, object] | None:
    """The first key (sorted) whose value differs between two flat config records (as
    :func:`trajectory_config` makes them), as ``(key, now, then)``; None when they agree."""
    for key in sorted(set(now) | set(then)):
        if now.get(key) != then.get(key):
            return key, now.get(key), then.get(key)
    return None


def trajectory_config(cfg: DictConfig) -> dict:
    """The resolved config, flattened to ``a.b`` keys, without the keys a resumed run may change
    (``run_invariant_keys``, and Hydra's own node)."""
    from effitrain.config.overrides import is_invariant

    may_change = {"hydra", *(cfg.get("run_invariant_keys") or [])}
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    for key in cfg:
        if key not in may_change:
            node = cfg[key]
            walk(OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node, f"{key}.")
    return {key: value for key, value in flat.items() if not is_invariant(key, may_change)}


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


def examine(folder: Path) -> tuple[dict | None, str | None]:
    """``(metadata, None)`` for a whole checkpoint; ``(None, why)`` when it cannot be resumed from
    (incomplete, or a file whose bytes differ from the checksum stored when it was saved)."""
    meta = read_meta(folder)
    if meta is None:
        return None, "incomplete (a file is missing or of the wrong size)"
    for name, expected in meta.get("sha256", {}).items():
        if sha256(folder / name) != expected:
            return None, f"{name} differs from its checksum (damaged)"
    if METADATA in meta["files"] and (why := refusal(folder)) is not None:  # checksums prove no origin
        return None, why
    return meta, None


def damage(folder: Path) -> str | None:
    """Why the checkpoint in ``folder`` cannot be resumed from, or None when it is whole."""
    return examine(folder)[1]


def read_meta(folder: Path) -> dict | None:
    """The checkpoint's ``effitrain.json`` when the folder is complete (every file at its size), else None."""
    try:
        meta = json.loads((folder / META).read_text())
        sizes = meta["files"]
        if meta.get("format") != FORMAT or not sizes:
            return None
        if any((folder / name).stat().st_size != size for name, size in sizes.items()):
            return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every finished checkpoint folder name under ``run_dir/checkpoints``, oldest first."""
    root = Path(run_dir) / FOLDER
    if root.is_symlink() or not root.is_dir():  # a link is nothing this run made (run/folders refuses it)
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if p.is_dir() and not p.is_symlink() and (m := _NAME.match(p.name))
    ]
    return sorted(found)


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from, with its metadata as read (and checked) when it was chosen:
    nothing reads ``effitrain.json`` again."""

    folder: Path
    meta: dict

    @property
    def step(self) -> int:
        return self.meta["step"]

    def position(self, batches_per_epoch: int, accumulation: int) -> Position:
        return position(self.step, batches_per_epoch, accumulation)

    def rng_state(self) -> dict:
        """This process's generators at the checkpoint (``weights_only``: no arbitrary unpickling)."""
        return torch.load(self.folder / rng_file_name(), weights_only=True)


def _newest_whole(run_dir: Path) -> ResumePoint | None:
    for _, folder in reversed(list_checkpoints(run_dir)):
        meta, why = examine(folder)
        if meta is not None:
            return ResumePoint(folder, meta)
        log.warning("skipping checkpoint %s: %s", folder, why)
        print(f"effitrain: warning: skipping checkpoint {folder}: {why}", file=sys.stderr, flush=True)
    return None


def newest_valid(run_dir: Path) -> Path | None:
    """The newest whole checkpoint; each damaged one skipped on the way is named, with why."""
    point = _newest_whole(run_dir)
    return point.folder if point is not None else None


def find_resume(cfg: DictConfig, output_dir: Path) -> ResumePoint | None:
    """The checkpoint ``cfg.resume`` points at: None, ``auto`` (newest valid in this run, if any) or a path.

    A path may name a checkpoint folder or a run folder (its newest valid checkpoint is taken).
    Everything that would stop the resume is checked here, before any model is built.

    Raises:
        ConfigError: the path holds no complete checkpoint; the checkpoint was written by a config
            that differs in a key that changes the training trajectory, or by another number of
            processes.
    """
    resume = cfg.get("resume")
    if resume is None:
        return None
    if resume == "auto":
        point = _newest_whole(output_dir)
        if point is None:
            log.info("resume=auto: no checkpoint in %s, starting from scratch", output_dir)
            return None
    else:
        path = Path(str(resume)).expanduser()
        if read_meta(path) is not None:  # a checkpoint folder, not a run folder
            meta, why = examine(path)
            if why is not None:
                raise invalid("resume", str(resume), f"the checkpoint is {why}")
            point = ResumePoint(path, meta)
        else:
            point = _newest_whole(path)
        if point is None:
            raise invalid(
                "resume", str(resume), "no complete checkpoint there (give auto, null or a checkpoint folder)"
            )
    folder, meta = point.folder, point.meta
    change = first_difference(trajectory_config(cfg), meta["config"])
    if change is not None:
        key, now, then = change
        raise invalid(
            key,
            now,
            f"differs from the checkpoint {folder} ({then!r}): an exact resume needs the same config",
        )
    if meta["world_size"] != launched_world_size():  # the front door asks before the group is joined
        raise invalid(
            "resume",
            str(folder),
            f"written by {meta['world_size']} processes, resumed with {launched_world_size()}",
        )
    return point


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
            if is_sharded(self.model):
                save_sharded(self.model, self.optimizer, tmp)
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
        from safetensors.torch import save_model

        if not is_sharded(self.model):  # else every rank wrote its shards (save_sharded)
            if not save_adapter(self.model, tmp):
                save_model(self.model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            for weights in tmp.glob("*.safetensors"):
                # safetensors writes 0600: the weights follow the umask as every other result file
                os.chmod(weights, 0o666 & ~_umask())
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
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
        from safetensors.torch import load_model

        folder, meta = self.resume.folder, self.resume.meta
        if weights:
            if is_sharded(self.model):
                load_sharded(self.model, self.optimizer, folder)
            else:
                device = next(self.model.parameters()).device
                if not load_adapter(self.model, folder, device):
                    load_model(self.model, str(folder / "model.safetensors"), strict=True, device=str(device))
                self.optimizer.load_state_dict(
                    torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
                )
            self.scheduler.load_state_dict(
                torch.load(folder / "scheduler.pt", map_location="cpu", weights_only=True)
            )
        self.meter.restore(meta["step"], **meta["meter"])
        at = self.resume.position(self.batches_per_epoch, self.cfg.gradient_accumulation_steps)
        log.info(
            "resumed from %s: step %d, epoch %d, %d micro-batches in", folder, at.step, at.epoch, at.batches
        )
        return at
