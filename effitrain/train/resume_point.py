"""Which checkpoint a run continues from: a run folder's checkpoints (``checkpoints/step-<N>``), whole or
damaged, and every check made before resuming from one (:func:`find_resume`), before any model is built.
What a checkpoint holds and how it is written: :mod:`effitrain.train.checkpoint`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from effitrain.config.errors import invalid
from effitrain.config.record import first_difference, trajectory_config
from effitrain.train.distributed import launched_world_size
from effitrain.train.rng import rng_file_name
from effitrain.train.sharded_checkpoint import METADATA, refusal
from effitrain.util.atomic import sha256

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


def position(step: int, batches_per_epoch: int, accumulation: int) -> Position:
    """Every optimizer step but an epoch's last takes ``accumulation`` micro-batches.

    A step that ends an epoch maps to the start of the next one, as the Trainer counts.
    """
    steps_per_epoch = math.ceil(batches_per_epoch / accumulation)
    epoch, steps_done = divmod(step, steps_per_epoch)
    return Position(step, epoch, steps_done * accumulation)


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
    if (
        root.is_symlink() or not root.is_dir()
    ):  # a link is nothing this run made (run/folder_policy refuses it)
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
