"""Multiruns: each job shares its sweep's compile cache and skips work already done; at the end the
parent process says how each job ended and exits non-zero when any failed.

    python train.py sweep=optimizers max_steps=20      # a named study from multirun_sweeps/
    python train.py -m optimizer=adamw,adafactor       # a plain Hydra multirun gets the same
    python train.py sweep=optimizers max_steps=20 hydra.sweep.dir=multirun/optimizers/<date_time>  # resume

Jobs run in their own processes (``hydra/launcher: submitit_local`` in ``conf/config.yaml``), so the
code here runs in two places: :func:`start_job` in each job's process, :class:`SweepReport` in the
parent's.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from effitrain import results

# The launcher's bookkeeping (.submitit) and the shared caches live in dot-folders of the sweep.
INDUCTOR_CACHE = ".cache/inductor"


def start_job(cfg: DictConfig, hydra_cfg: DictConfig) -> dict | None:
    """Prepare one job of a multirun; return its earlier ok summary when it is to be skipped."""
    # Inductor's cache defaults to /tmp of each machine; under the sweep folder it is shared by all
    # jobs of the sweep, on one box or across cluster nodes, so later compile=on jobs start faster.
    cache = Path(hydra_cfg.sweep.dir).resolve() / INDUCTOR_CACHE
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
    if not cfg.get("skip_ok_jobs", True):
        return None
    previous = results.read_summary(Path(hydra_cfg.runtime.output_dir))
    if previous is None or previous.get("status") != "ok":
        return None
    print(
        f"effitrain: skip: {hydra_cfg.runtime.output_dir} already holds an ok summary.json (skip_ok_jobs=true)"
    )
    return previous


def job_folders(root: Path) -> list[Path]:
    """Folders under ``root`` (itself included) that hold a job: its summary.json or Hydra's record.

    Dot-folders (.submitit, .cache with thousands of Inductor files, .hydra) are not searched.
    """
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        if results.SUMMARY in files or os.path.exists(os.path.join(folder, ".hydra", "overrides.yaml")):
            found.append(Path(folder))
    return found


@dataclass
class JobOutcome:
    folder: Path
    status: str  # ok | failed | oom | diverged | missing (no summary.json: the process died)
    skipped: bool
    error: str | None


def sweep_outcomes(sweep_dir: Path, since: float) -> list[JobOutcome]:
    """The jobs Hydra started in ``sweep_dir`` at or after ``since`` (a ``time.time()``).

    Hydra writes each job's ``.hydra/overrides.yaml`` before the job runs, also for a job that then
    skips itself, so its time tells this sweep's jobs from older ones in the same folder.
    """
    outcomes = []
    started = [(folder / ".hydra" / "overrides.yaml", folder) for folder in job_folders(Path(sweep_dir))]
    started = sorted((path.stat().st_mtime, folder) for path, folder in started if path.exists())
    for mtime, folder in started:  # in launch order
        if mtime < since:
            continue
        summary = results.read_summary(folder)
        if summary is None:
            outcomes.append(JobOutcome(folder, "missing", False, "no summary.json (the job's process died)"))
            continue
        skipped = (folder / results.SUMMARY).stat().st_mtime < since
        outcomes.append(JobOutcome(folder, summary.get("status", "missing"), skipped, summary.get("error")))
    return outcomes


class SweepReport(Callback):
    """Hydra callback (``hydra.callbacks.sweep_report``): after a multirun, report every job and
    exit with status 1 when any failed, so scripts and CI see it."""

    def __init__(self) -> None:
        self.started = time.time()

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.started = time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        outcomes = sweep_outcomes(sweep_dir, self.started)
        for job in outcomes:
            how = "ok (skipped: ok before)" if job.skipped else job.status
            line = f"effitrain: {how}: {job.folder.relative_to(sweep_dir)}"
            print(line if job.status == "ok" else f"{line}: {job.error}")
        failed = sum(job.status != "ok" for job in outcomes)
        skipped = sum(job.skipped for job in outcomes)
        print(
            f"effitrain: {failed} of {len(outcomes)} jobs failed ({skipped} skipped: ok before) in {sweep_dir}"
        )
        print(f"effitrain: compare: effitrain compare {shlex.quote(str(sweep_dir))}")
        if failed:
            args = [arg for arg in sys.argv if not arg.startswith("hydra.sweep.dir=")]
            resume = shlex.join(["python", *args, f"hydra.sweep.dir={sweep_dir}"])
            print(f"effitrain: rerun the failed jobs only: {resume}")
            sys.exit(1)
