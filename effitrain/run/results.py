"""Result files of a run: ``summary.json`` (atomic) and ``metrics.jsonl`` (a line per step)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from importlib import metadata
from pathlib import Path

from effitrain.train.loggers import plain, without_secret
from effitrain.util.atomic import write_atomic

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"


def write_text_atomic(path: Path, text: str) -> None:
    """Never half a file (:func:`effitrain.util.atomic.write_atomic`), readable by colleagues."""
    write_atomic(path, text)


def write_json_atomic(path: Path, payload: dict) -> None:
    write_text_atomic(
        path, json.dumps({k: plain(v) for k, v in payload.items()}, indent=2, sort_keys=True) + "\n"
    )


LOCK = ".effitrain.lock"


@contextlib.contextmanager
def folder_lock(folder: Path):
    """Hold an exclusive lock on ``folder`` (a lock file in it); yields None when this process has
    it, else the pid of the process that does. Released when the process dies, however it dies.
    Ranks of one data-parallel job share their folder: only rank 0 locks it.

    The lock file is removed when the lock is let go, so a finished run leaves none behind. It is
    removed while still held, and a process that gets the lock keeps it only if the file it locked is
    still the one at the path (:func:`_lock_file`): one that waited on a file removed meanwhile tries
    again on the file now there, so two processes never hold the folder at once."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield None
        return
    # a job of effitrain's launcher: the sweep's process holds its folder's lock for it
    if os.environ.get("EFFITRAIN_FOLDER_LOCKED") == str(Path(folder).resolve()):
        yield None
        return
    import fcntl

    path = Path(folder) / LOCK
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, owner = _lock_file(path)
    except OSError:  # an unwritable folder is reported by the run itself, with its own message
        yield None
        return
    if handle is None:
        yield owner
        return
    with handle:
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
        except OSError:  # a full disk: the lock holds all the same, only its pid is not written
            pass
        try:
            yield None
        finally:
            if _same_file(handle, path):  # removed while held: see _lock_file
                path.unlink(missing_ok=True)
            fcntl.flock(handle, fcntl.LOCK_UN)


def _lock_file(path: Path):
    """``(handle, None)``: ``path`` opened and flock'ed by this process, still the file at ``path``;
    or ``(None, owner)``: another process holds it (the pid it wrote, or ``"unknown"``).

    A holder removes the file before letting go, so a file locked here may no longer be the one at
    ``path`` (its holder removed it between our open and our flock, and a third process may have
    made a new one since): then it is closed and the file now at ``path`` is tried."""
    import fcntl

    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with handle:
                handle.seek(0)
                return None, handle.read().strip() or "unknown"
        if _same_file(handle, path):
            return handle, None
        handle.close()


def _same_file(handle, path: Path) -> bool:
    """Whether the open ``handle`` is the file at ``path`` now (not one removed since)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def read_summary(folder: Path) -> dict | None:
    path = Path(folder) / SUMMARY
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return summary if isinstance(summary, dict) else None  # valid JSON but not a summary: unreadable


def finished_run(cfg, folder: Path) -> str | None:
    """A line saying ``folder`` holds a finished ok run that ``resume=auto`` leaves as it is, or None
    when there is nothing there to keep.

    Raises:
        ConfigError: the folder holds an ok run and this is no resume: running would overwrite it.
    """
    from effitrain.config.errors import ConfigError
    from effitrain.train.checkpoint import list_checkpoints

    previous = read_summary(folder)
    if previous is None or previous.get("status") != "ok":
        saved = list_checkpoints(folder)
        if saved and cfg.get("resume") is None:  # a fresh start would rotate them away
            raise ConfigError(
                f"hydra.run.dir={str(folder)!r} is invalid: it holds an unfinished run's checkpoints "
                f"(newest: step {saved[-1][0]}); add resume=auto to continue it, or give another folder"
            )
        return None
    if cfg.get("resume") != "auto":  # resume=<path> starts this folder's run anew from elsewhere
        raise ConfigError(
            f"hydra.run.dir={str(folder)!r} is invalid: it holds a finished ok run (summary.json); "
            "give another folder, or add resume=auto to keep it as it is"
        )
    change = config_change(previous, cfg)
    if change is not None:
        key, now, was = change
        raise ConfigError(
            f"{key}={now!r} is invalid: the finished ok run in {folder} ran with {was!r}, and resume=auto "
            "keeps it as it is: give another folder for this config"
        )
    return f"effitrain: {folder} already holds a finished ok run (resume=auto): left as it is"


CONFIG_KEY = "job/config"  # summary.json: the run's result-changing configuration


def config_record(cfg) -> dict:
    """The result-changing configuration of a run, as ``summary.json`` records it under ``job/config``:
    the resolved config without ``run_invariant_keys`` (:func:`effitrain.train.checkpoint.trajectory_config`),
    ``micro_batch_size`` derived from ``effective_batch_size``, as JSON values."""
    import copy

    from effitrain.config.load import apply_effective_batch_size
    from effitrain.train.checkpoint import trajectory_config

    derived = copy.deepcopy(cfg)
    apply_effective_batch_size(derived, int(os.environ.get("WORLD_SIZE", "1")))
    record = json.loads(json.dumps(trajectory_config(derived), default=str))
    secret = os.environ.get("WANDB_API_KEY")  # a key pulled in by interpolation is never written
    return without_secret(record, secret)


def config_change(previous: dict, cfg) -> tuple[str, object, object] | None:
    """The first key (sorted) whose value in ``cfg`` differs from the one recorded in the earlier
    summary ``previous``, as ``(key, now, then)``; None when they agree or nothing was recorded."""
    from effitrain.train.checkpoint import first_difference

    recorded = previous.get(CONFIG_KEY)
    if not isinstance(recorded, dict):
        return None
    return first_difference(config_record(cfg), recorded)


def skip_refusal(folder: Path, previous: dict, cfg) -> str | None:
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


def folder_in_use(folder: Path) -> str | None:
    """The pid of the process holding ``folder``'s lock (:func:`folder_lock`), or None; writes nothing.
    Only rank 0 asks, as only rank 0 locks: another rank would find its own job's rank 0 there."""
    import fcntl

    if int(os.environ.get("RANK", "0")) != 0:
        return None

    try:
        handle = open(Path(folder) / LOCK)
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read().strip() or "unknown"
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def env_info(device: str) -> dict:
    """Versions read from package metadata, so nothing heavy (bitsandbytes) is imported for them."""
    return {
        "env/torch": _version("torch"),
        "env/transformers": _version("transformers"),
        "env/accelerate": _version("accelerate"),
        "env/bitsandbytes": _version("bitsandbytes"),
        "env/device": device,
        "env/git_commit": git_commit(),
        "env/pid": os.getpid(),  # a sweep runs each job in its own process: distinct pids show it
        # the devices effitrain's launcher gave the job (or the shell gave the run)
        "env/cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "env/cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "env/num_threads": _torch_threads(),
    }


def _torch_threads() -> int | None:
    import sys

    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None
