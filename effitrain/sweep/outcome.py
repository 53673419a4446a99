"""How a job of a local sweep ended, decided by the launcher from its process's exit and what it
wrote (:func:`job_outcome`); a job stopped from outside (killed, timed out, stopped before it could
say so) gets its summary.json written here."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from effitrain.run import results
from effitrain.sweep.report import JobOutcome, signal_name
from effitrain.train.loggers import read_metrics

JOB_LOG = "job.log"  # a job's stdout and stderr, in its own folder


def file_id(path: Path):
    """What tells a file rewritten by the job (an atomic write makes a new inode) from the old one."""
    with contextlib.suppress(OSError):
        stat = path.stat()
        return stat.st_ino, stat.st_mtime_ns, stat.st_size
    return None


@dataclass
class LaunchedJob:
    """One job of a local sweep, as the launcher starts, watches and records it."""

    idx: int
    overrides: list
    config: DictConfig
    folder: Path
    name: str  # the folder relative to the sweep's
    label: str = ""  # what sets it apart from the sweep's other jobs, for its console lines
    lock: contextlib.ExitStack | None = None  # the folder's, held while the job runs
    process: subprocess.Popen | None = None
    gpus: list | None = None
    cpus: list | None = None
    started: float = 0.0
    deadline: float = 0.0  # when it is sent SIGTERM (timeout_min), or SIGKILL (kill_grace_s after a signal)
    summary_before: tuple | None = None
    metrics_before: tuple | None = None
    stop_signal: int | None = None  # what the launcher sent it (a timeout or the sweep's stop)
    timed_out: bool = False
    outcome: JobOutcome | None = None
    value: object = None

    def result(self, specs: Path) -> Path:
        return specs / f"job-{self.idx}.json"


def job_outcome(job: LaunchedJob, code: int, result: dict | None, timeout_min) -> JobOutcome:
    """How the job ended, from its exit and what it wrote; a job that could not write its own
    summary (killed outright, timed out) gets one written here."""
    log = job.folder / JOB_LOG
    summary = results.read_summary(job.folder)
    rewritten = file_id(job.folder / results.SUMMARY) != job.summary_before  # by this attempt
    written = summary if rewritten else None
    if written is not None and written.get("status") == "ok":
        return JobOutcome(job.folder, "ok", False, None, log)
    signum = -code if code < 0 else None
    stopped = None
    if job.timed_out:
        error = f"ran longer than hydra.launcher.timeout_min={timeout_min}: stopped by "
        stopped = ("timeout", signum or job.stop_signal, error + signal_name(signum or job.stop_signal))
    elif job.stop_signal is not None and signum != signal.SIGKILL and not rewritten:
        # the sweep stopped it (Ctrl-C, SIGTERM) before it could say so itself (still starting)
        error = f"interrupted by {signal_name(job.stop_signal)} (the sweep was stopped)"
        stopped = ("interrupted", job.stop_signal, error)
    elif signum is not None and not (written is not None and written.get("status") == "interrupted"):
        error = f"killed by {signal_name(signum)}"
        if signum == signal.SIGKILL and job.stop_signal is None:
            error += " (from outside: the kernel's OOM killer sends it when memory runs out)"
        elif signum == signal.SIGKILL:
            error += (
                f" after {signal_name(job.stop_signal)}: it did not stop within hydra.launcher.kill_grace_s"
            )
        stopped = ("killed", signum, error)
    if stopped is not None:
        _write_stopped(job, *stopped, written)
        return JobOutcome(job.folder, stopped[0], False, stopped[2], log)
    if written is not None:
        return JobOutcome(job.folder, written.get("status", "failed"), False, written.get("error"), log)
    if result is not None and not result.get("completed"):
        return JobOutcome(job.folder, "failed", False, result.get("error"), log)
    if code == 0 and result is not None:
        # the task wrote no new summary: a finished run resume=auto kept, or a task that writes none
        status = summary.get("status", "failed") if summary else "ok"
        return JobOutcome(job.folder, status, False, summary.get("error") if summary else None, log)
    error = f"its process exited with code {code} and no summary.json: see {log}"
    return JobOutcome(job.folder, "failed", False, error, log)


def _write_stopped(job: LaunchedJob, status: str, signum: int, error: str, summary: dict | None) -> None:
    """The summary of a job stopped from outside: what it wrote itself, if anything (an
    interrupted run's measurements), else its config keys and the steps its metrics show."""
    if summary is None:
        summary = {}
        with contextlib.suppress(Exception):  # the keys are context; the status is written regardless
            from effitrain.run.summary_keys import summary_config_keys

            summary.update(summary_config_keys(job.config, job.folder, 1))
        if file_id(job.folder / results.METRICS) != job.metrics_before:
            steps = [r["step"] for r in read_metrics(job.folder / results.METRICS) if "train/loss" in r]
            summary["train/steps"] = max(steps, default=0)
        summary["env/pid"] = job.process.pid
        summary["env/cuda_visible_devices"] = ",".join(job.gpus) if job.gpus is not None else None
        summary["env/cpu_affinity"] = job.cpus
    summary.update({"status": status, "error": error, "signal": int(signum)})
    results.write_json_atomic(job.folder / results.SUMMARY, summary)
