"""How a multirun's jobs ended: the closing report (:class:`SweepReport`, a Hydra callback, in the
sweep's process) and what it reads: the record effitrain's launcher keeps (:data:`RECORD`), or the
job folders on disk (:func:`job_folders`, which ``effitrain compare`` reads too).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from effitrain.run import results


def job_folders(root: Path) -> list[Path]:
    """Folders under ``root`` (itself included) that hold a job: its summary.json or Hydra's record.

    Dot-folders (.effitrain, .submitit, .cache with thousands of Inductor files, .hydra) are not searched.
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
    # ok | failed | oom | diverged | interrupted | killed | timeout | busy (another process has the
    # folder) | not started (the sweep was stopped first) | missing (no summary.json)
    status: str
    skipped: bool
    error: str | None
    log: Path | None = None


@dataclass
class SweepRecord:
    """For :class:`SweepReport`: every job effitrain's launcher was handed in this process (None: it
    ran none, another launcher did), and the signal that stopped the sweep, if one did."""

    jobs: list[JobOutcome] | None = None
    signal: int | None = None


RECORD = SweepRecord()


def sweep_outcomes(sweep_dir: Path, since: float) -> list[JobOutcome]:
    """The jobs started in ``sweep_dir`` at or after ``since`` (a ``time.time()``), found on disk:
    the report of a launcher other than effitrain's (submitit_slurm), which keeps no record here.

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


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class SweepReport(Callback):
    """Hydra callback (``hydra.callbacks.sweep_report``): after a multirun, report every job and
    exit with status 1 when any is not ok (128 + the signal when the sweep was stopped), so
    scripts and CI see it."""

    def __init__(self) -> None:
        self.started = time.time()

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.started = time.time()
        RECORD.jobs, RECORD.signal = None, None

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        # effitrain's launcher: the jobs Hydra handed it, whatever is on disk; another: what is on disk
        outcomes = RECORD.jobs if RECORD.jobs is not None else sweep_outcomes(sweep_dir, self.started)
        outcomes = [_recheck(job) for job in outcomes]
        for job in outcomes:
            how = "ok (skipped: ok before)" if job.skipped else job.status
            line = f"effitrain: {how}: {os.path.relpath(job.folder, sweep_dir)}"
            line += f": {job.error}" if job.status != "ok" else ""
            print(line + (f" (log: {job.log})" if job.log is not None and job.log.exists() else ""))
        count = Counter(job.status for job in outcomes)
        notes = [f"{sum(job.skipped for job in outcomes)} skipped: ok before"]
        notes += [f"{count['busy']} in use by another sweep, not run"] if count["busy"] else []
        notes += [f"{count['not started']} not started"] if count["not started"] else []
        failed = len(outcomes) - count["ok"] - count["busy"] - count["not started"]
        print(f"effitrain: {failed} of {len(outcomes)} jobs failed ({', '.join(notes)}) in {sweep_dir}")
        print(f"effitrain: compare: effitrain compare {shlex.quote(str(sweep_dir))}")
        from effitrain.train.loggers import offline_sync_hint

        hint = offline_sync_hint(sweep_dir)
        if hint:  # once for the sweep, not once per job
            print(hint)
        if count["ok"] < len(outcomes):  # busy and not started too: not done by this sweep either
            args = [arg for arg in sys.argv if not arg.startswith("hydra.sweep.dir=")]
            if not any(arg.startswith("resume=") for arg in args) and _left_checkpoints(outcomes):
                args.append("resume=auto")  # a fresh start into a folder with checkpoints is refused
            resume = shlex.join(["python", *args, f"hydra.sweep.dir={sweep_dir}"])
            print(f"effitrain: rerun the jobs that are not ok: {resume}")
        sys.stdout.flush()
        if RECORD.signal is not None:
            print(f"effitrain: error: the sweep was stopped by {signal_name(RECORD.signal)}", file=sys.stderr)
            sys.exit(128 + RECORD.signal)
        if count["ok"] < len(outcomes):
            sys.exit(1)


def _left_checkpoints(outcomes: list[JobOutcome]) -> bool:
    """Whether a job that is not ok left checkpoints in its folder (a rerun then needs resume=auto)."""
    from effitrain.train.checkpoint import list_checkpoints

    return any(job.status != "ok" and list_checkpoints(job.folder) for job in outcomes)


def _recheck(job: JobOutcome) -> JobOutcome:
    """A job left to another sweep is reported as that sweep left it, if it has finished."""
    if job.status != "busy":
        return job
    summary = results.read_summary(job.folder)
    if summary is not None and summary.get("status") == "ok":
        return JobOutcome(job.folder, "ok", False, None)
    return job
