"""The one folder policy: whether a run or a sweep's job may use its folder (:func:`decide`), and the
lock that keeps the answer true while it runs (:func:`claimed`: lock, then decide, one step).

Everyone asks here: ``train.py``'s preflight (before Hydra writes ``.hydra/``), effitrain's launcher
(before it starts a process), a job started by another launcher (:func:`effitrain.sweep.worker.start_job`)
and the run itself (:mod:`effitrain.run.recipe`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from omegaconf import DictConfig

from effitrain.config.errors import ConfigError, invalid
from effitrain.config.record import first_difference, trajectory_config, without_secret
from effitrain.run.results import read_summary
from effitrain.util.atomic import probe_write
from effitrain.util.links import link_refusal

LOCK = ".effitrain.lock"  # holds the holder's pid; removed when the lock is let go
CONFIG_KEY = "job/config"  # summary.json: the run's result-changing configuration
# Set for a job's process by effitrain's launcher: the folder the sweep's process holds locked for it.
LOCKED_ENV = "EFFITRAIN_FOLDER_LOCKED"
# The summary's cfg/* keys whose config key is not their name (the rest are cfg/<key>).
SUMMARY_KEY_NAMES = {"cfg/lr": "optimizer.lr", "cfg/model_name_or_path": "model.name_or_path"}


@dataclass(frozen=True)
class Decision:
    """What may be done with a folder. ``run``: start (fresh or resumed); ``skip``: a sweep's job
    done before with this config; ``keep``: ``resume=auto`` of a finished ok run, left as it is;
    ``refuse``: ``reason`` says why in one line; ``busy``: another process holds it (``owner``)."""

    action: Literal["run", "skip", "keep", "refuse", "busy"]
    reason: str | None = None  # refuse: the error; skip and keep: the line a user is shown
    previous: dict | None = None  # the folder's summary.json, when there is one
    owner: str | None = None  # busy: the holder's pid as it wrote it ("unknown" if it wrote none)


def decide(folder: Path, cfg: DictConfig, job_of_sweep: bool = False) -> Decision:
    """The folder policy for ``cfg`` run into ``folder``; nothing is written.

    ``job_of_sweep``: the sweep's question, asked before any process starts: may this job be skipped
    (``skip_ok_jobs``) as done, or is it refused (another config than the ok run's, or than the
    checkpoint ``resume`` names)? A job that is not settled asks again as a run when it starts.
    """
    folder = Path(folder)
    planted = link_refusal("hydra.run.dir", folder)
    if planted is not None:  # before anything reads or writes there
        return Decision("refuse", planted)
    previous = read_summary(folder)
    ok = finished_ok(previous, cfg)
    if job_of_sweep:
        if not ok and cfg.get("resume") is not None:  # a checkpoint it could not resume: refused now
            return _resumable(folder, cfg, previous)
        if not ok or not cfg.get("skip_ok_jobs", True):
            return Decision("run", previous=previous)
        refusal = skip_refusal(folder, previous, cfg)
        if refusal is not None:  # not done: it ran another config, which a run would not overwrite
            return Decision("refuse", refusal, previous)
        done = f"effitrain: skip: {folder} already holds an ok summary.json (skip_ok_jobs=true)"
        return Decision("skip", done, previous)
    where = f"hydra.run.dir={str(folder)!r} is invalid"
    if not ok:
        from effitrain.train.resume_point import list_checkpoints  # torch: not in a sweep's process

        saved = list_checkpoints(folder)
        if saved and cfg.get("resume") is None:  # a fresh start would rotate them away
            why = f"it holds an unfinished run's checkpoints (newest: step {saved[-1][0]})"
            return Decision(
                "refuse", f"{where}: {why}; add resume=auto to continue it, or give another folder", previous
            )
        return _resumable(folder, cfg, previous)
    if cfg.get("resume") != "auto":  # resume=<path> starts this folder's run anew from elsewhere
        why = "give another folder, or add resume=auto to keep it as it is"
        return Decision("refuse", f"{where}: it holds a finished ok run (summary.json); {why}", previous)
    change = config_change(previous, cfg)
    if change is not None:
        key, now, was = change
        why = f"the finished ok run in {folder} ran with {was!r}, and resume=auto keeps it as it is"
        return Decision(
            "refuse", f"{key}={now!r} is invalid: {why}: give another folder for this config", previous
        )
    decision = _resumable(folder, cfg, previous)
    if decision.action == "refuse":
        return decision
    kept = f"effitrain: {folder} already holds a finished ok run (resume=auto): left as it is"
    return Decision("keep", kept, previous)


def finished_ok(summary: dict | None, cfg: DictConfig) -> bool:
    """Whether ``summary`` is a finished ok run's: status ok, its config record (``job/config``, or an
    older version's ``cfg/*`` keys) and a finite optimized metric (``eval/loss`` by default). A status
    alone (a summary edited, forged or cut short) is not one: it is never skipped as done, and its
    folder is run again."""
    if summary is None or summary.get("status") != "ok":
        return False
    recorded = isinstance(summary.get(CONFIG_KEY), dict) or any(key.startswith("cfg/") for key in summary)
    metric = summary.get(cfg.get("optimized_metric", "eval/loss"))
    finite = isinstance(metric, (int, float)) and not isinstance(metric, bool) and math.isfinite(metric)
    return recorded and finite


def _resumable(folder: Path, cfg: DictConfig, previous: dict | None) -> Decision:
    """``run``, or ``refuse`` when the checkpoint ``resume`` names could not be resumed (another
    config): said before anything is written, so an interrupted run's folder stays as it was."""
    from effitrain.train.resume_point import find_resume  # imports torch: only when needed

    try:
        find_resume(derived(cfg), folder)
    except ConfigError as error:
        return Decision("refuse", str(error), previous)
    return Decision("run", previous=previous)


def finished_run(cfg: DictConfig, folder: Path) -> str | None:
    """The run's own question (:func:`decide`), as the run asks it: the line saying a finished ok
    run is kept (``resume=auto``), or None: there is a run to do.

    Raises:
        ConfigError: the folder may not be used for this config (the reason, in one line).
    """
    decision = decide(folder, cfg)
    if decision.action == "refuse":
        raise ConfigError(decision.reason)
    return decision.reason if decision.action == "keep" else None


@contextlib.contextmanager
def claimed(folder: Path, cfg: DictConfig, job_of_sweep: bool = False):
    """Lock ``folder``, then :func:`decide`, as one step: yields the decision (``busy`` when another
    process holds the folder), the lock held until the block ends when it is ``run``.

    A folder no one holds whose decision is not ``run`` (refuse, skip, keep) is settled without
    taking the lock, so nothing there is written, not even a dead holder's lock file replaced; a folder
    holding a planted link is refused before its lock file is opened."""
    if link_refusal("hydra.run.dir", folder) is not None or folder_in_use(folder) is None:
        decision = decide(folder, cfg, job_of_sweep)
        if decision.action != "run":
            yield decision
            return
    with folder_lock(folder) as owner:
        yield Decision("busy", owner=owner) if owner is not None else decide(folder, cfg, job_of_sweep)


def derived(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` as the run derives it (:func:`effitrain.config.load.derive`), for this process's
    ``WORLD_SIZE``."""
    from effitrain.config.load import derive

    derived = copy.deepcopy(cfg)
    derive(derived, int(os.environ.get("WORLD_SIZE", "1")))
    return derived


def config_record(cfg: DictConfig) -> dict:
    """The result-changing configuration of a run, as ``summary.json`` records it under ``job/config``:
    the resolved config without ``run_invariant_keys`` (:func:`effitrain.config.record.trajectory_config`),
    ``micro_batch_size`` derived from ``effective_batch_size``, as JSON values."""

    record = json.loads(json.dumps(trajectory_config(derived(cfg)), default=str))
    secret = os.environ.get("WANDB_API_KEY")  # a key pulled in by interpolation is never written
    return without_secret(record, secret)


def config_change(previous: dict, cfg: DictConfig) -> tuple[str, object, object] | None:
    """The first key (sorted) whose value in ``cfg`` differs from the one recorded in the earlier
    summary ``previous``, as ``(key, now, then)``; None when they agree.

    A summary without the full record (an older version's, or edited) is compared on the ``cfg/*``
    keys it holds; one that holds neither has nothing to compare and is taken as it is.
    """
    recorded = previous.get(CONFIG_KEY)
    if isinstance(recorded, dict):
        return first_difference(config_record(cfg), recorded)
    said = {key: value for key, value in previous.items() if key.startswith("cfg/")}
    if not said:
        return None
    from effitrain.run.summary_keys import summary_config_keys

    now = summary_config_keys(derived(cfg), Path("."), int(os.environ.get("WORLD_SIZE", "1")))
    change = first_difference({key: now.get(key) for key in said}, said)
    if change is None:
        return None
    key, now_value, was = change
    return SUMMARY_KEY_NAMES.get(key, key.removeprefix("cfg/")), now_value, was


def skip_refusal(folder: Path, previous: dict, cfg: DictConfig) -> str | None:
    """Why a sweep may not skip ``folder``'s ok run ``previous`` as done (it ran another value of a
    key, named), or None when it may."""
    change = config_change(previous, cfg)
    if change is None:
        return None
    key, now, was = change
    return (
        f"{key}={now!r} is invalid: {folder} holds an ok run with {key}={was!r}, which this sweep "
        "would skip as done: give another hydra.sweep.dir"
    )


def check_output_dir(path: Path) -> None:
    """Raises ConfigError when results could not be written to ``path``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe_write(path)  # a file of its own: ranks of one job probe one folder at one moment
    except OSError as error:
        raise invalid(
            "hydra.run.dir", str(path), f"the output folder cannot be written ({error.strerror})"
        ) from None
    planted = link_refusal("hydra.run.dir", path)
    if planted is not None:
        raise ConfigError(planted)


_HELD_HERE: set[str] = set()  # folders this process holds for a run it starts itself (:func:`held_here`)


@contextlib.contextmanager
def held_here(folder: Path):
    """Tell a run started in this process (by Hydra, after ``train.py``'s preflight took the lock)
    that its folder is held for it; child processes are not told (they hold nothing)."""
    key = str(Path(folder).resolve())
    _HELD_HERE.add(key)
    try:
        yield
    finally:
        _HELD_HERE.discard(key)


@contextlib.contextmanager
def folder_lock(folder: Path):
    """Hold an exclusive lock on ``folder`` (``filelock``'s flock on a file in it); yields None when
    this process has it, else the pid the holder wrote there ("unknown" before it wrote one).
    Released when the process dies, however it dies. A folder held for this process (``LOCKED_ENV``:
    by effitrain's launcher; :func:`held_here`: by ``train.py``'s preflight) is not locked again.
    Ranks of one data-parallel job share their folder: only rank 0 locks it.

    The file is removed while still held, as the lock is let go, so a finished run leaves none
    behind: a process that was waiting on the removed file finds it unlinked and locks the new one
    (``filelock`` checks), so two processes never hold the folder at once."""
    from filelock import FileLock, Timeout

    folder = Path(folder)
    locked_for_us = str(folder.resolve()) in (os.environ.get(LOCKED_ENV), *_HELD_HERE)
    if int(os.environ.get("RANK", "0")) != 0 or locked_for_us:
        yield None
        return
    path = folder.resolve() / LOCK
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # no soft fallback: a marker file would outlive a killed holder (without flock nothing is locked);
        # a short wait: a holder letting go as we try is not reported as in use
        lock = FileLock(path, timeout=0.2, fallback_to_soft=False, on_acquired=_write_pid)
        lock.acquire()
    except Timeout:
        yield _owner(path)
        return
    except OSError:  # an unwritable folder is reported by the run itself, with its own message
        yield None
        return
    try:
        yield None
    finally:
        path.unlink(missing_ok=True)
        lock.release()


def _write_pid(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError:  # a full disk: the lock holds all the same, only its pid is not written
        pass


def _owner(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def folder_in_use(folder: Path) -> str | None:
    """The pid of the process holding ``folder``'s lock (:func:`folder_lock`), or None; writes nothing.
    Only rank 0 asks, as only rank 0 locks: another rank would find its own job's rank 0 there."""
    from filelock import FileLock, Timeout

    path = Path(folder).resolve() / LOCK
    if int(os.environ.get("RANK", "0")) != 0 or not path.exists() or path.is_symlink():
        return None  # a linked lock file is not opened: the folder is refused (:func:`decide`)
    try:
        with FileLock(path, timeout=0, fallback_to_soft=False):
            return None
    except Timeout:
        return _owner(path)
