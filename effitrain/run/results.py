"""A run's result files: ``summary.json`` (atomic), ``metrics.jsonl`` (a line per step), where they are."""

from __future__ import annotations

import json
import os
import subprocess
from importlib import metadata
from pathlib import Path

from effitrain.train.loggers import plain
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


def read_summary(folder: Path) -> dict | None:
    return read_json(Path(folder) / SUMMARY)


def read_json(path: Path) -> dict | None:
    """A JSON object from ``path`` (data, never code); None when absent, unreadable or not an object."""
    try:
        return json_object(Path(path).read_bytes())
    except OSError:
        return None


def json_object(data: bytes | str) -> dict | None:
    """``data`` as a JSON object; None when it is not one (empty, cut short, another JSON value)."""
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def job_folders(root: Path) -> list[Path]:
    """Folders under ``root`` (itself included) that hold a job: its summary.json or Hydra's record.

    Dot-folders (.effitrain, .submitit, .cache with thousands of Inductor files, .hydra) are not searched.
    """
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        if SUMMARY in files or os.path.exists(os.path.join(folder, ".hydra", "overrides.yaml")):
            found.append(Path(folder))
    return found


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
