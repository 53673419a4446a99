"""How a multirun's jobs ended: the closing report (:class:`SweepReport`, a Hydra callback in the sweep's
process), from the record effitrain's launcher keeps (:data:`RECORD`) or, for another launcher, the disk.
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
from effitrain.train.loggers import offline_sync_hint


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
    """Every job effitrain's launcher was handed in this process (None: another launcher ran them),
    and the signal that stopped the sweep, if one did."""

    jobs: list[JobOutcome] | None = None
    signal: int | None = None


RECORD = SweepRecord()


def sweep_outcomes(sweep_dir: Path, since: float) -> list[JobOutcome]:
    """This sweep's jobs on disk, in launch order, for a launcher that keeps no record (submitit_slurm):
    Hydra writes a job's ``.hydra/overrides.yaml`` before it runs (a skipped one too), after ``since``."""
    records = [
        (folder / ".hydra" / "overrides.yaml", folder) for folder in results.job_folders(Path(sweep_dir))
    ]
    outcomes = []
    for mtime, folder in sorted((path.stat().st_mtime, folder) for path, folder in records if path.exists()):
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
    return next((s.name for s in signal.Signals if s == number), f"signal {number}")


class SweepReport(Callback):
    """Hydra callback (``hydra.callbacks.sweep_report``): after a multirun, a line per job, and exit status
    1 when any is not ok (128 + the signal when the sweep was stopped), so scripts and CI see it."""

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
    from effitrain.train.resume_point import list_checkpoints

    return any(job.status != "ok" and list_checkpoints(job.folder) for job in outcomes)


def _recheck(job: JobOutcome) -> JobOutcome:
    """A job left to another sweep is reported as that sweep left it, if it has finished ok."""
    summary = results.read_summary(job.folder) if job.status == "busy" else None
    return JobOutcome(job.folder, "ok", False, None) if summary and summary.get("status") == "ok" else job
