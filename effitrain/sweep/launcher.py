"""effitrain's launcher (``hydra/launcher=effitrain``, the default): each job in a process of its own
(:mod:`effitrain.sweep.worker`, its output in ``<job>/job.log``), watched by one loop in the sweep's
process. effitrain adds the folder policy before a process starts (:func:`effitrain.run.folder_policy.claimed`),
one slot per running job (its GPUs, its CPU cores), timeouts, signals forwarded, and how each job ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobStatus, configure_log, setup_globals
from omegaconf import DictConfig, open_dict

from effitrain.config.errors import ConfigError, fail
from effitrain.config.schema import launcher_settings
from effitrain.run import folder_policy, results
from effitrain.run.summary_keys import summary_config_keys
from effitrain.sweep.report import RECORD, JobOutcome, signal_name
from effitrain.sweep.slots import job_slots
from effitrain.train.loggers import read_metrics
from effitrain.util.compat import job_return
from effitrain.util.links import link_refusal, open_no_follow

LAUNCHER_DIR = ".effitrain"  # <sweep>/.effitrain: launches.jsonl
LAUNCHES = "launches.jsonl"  # one line per job: folder, pid, devices, start and end, how it ended
ROOT = Path(__file__).resolve().parents[2]  # holds effitrain and hydra_plugins in a source checkout
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
    result: BinaryIO | None = None  # what its process says of its task (JSON, in an unnamed file)
    gpus: str | None = None  # its CUDA_VISIBLE_DEVICES
    cpus: list | None = None
    started: float = 0.0
    deadline: float = 0.0  # when it is sent SIGTERM (timeout_min), or SIGKILL (kill_grace_s after a signal)
    before: dict | None = None  # file_id of its summary.json and metrics.jsonl when it started
    stop_signal: int | None = None  # what the launcher sent it (a timeout or the sweep's stop)
    timed_out: bool = False
    outcome: JobOutcome | None = None
    value: object = None


class LocalSweep:
    """One batch of jobs on this machine: decide, start, watch, stop and record them."""

    def __init__(self, launcher, job_overrides, initial_job_idx: int):
        setup_globals()
        configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
        self.launcher = launcher
        try:
            self.settings = launcher_settings(launcher.params)
        except ConfigError as error:  # an app other than train.py, whose preflight checks them first
            fail(str(error))
        self.sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
        planted = link_refusal("hydra.sweep.dir", self.sweep_dir)
        if planted is not None:  # train.py's preflight said it first; an app of its own is told here
            fail(planted)
        (self.sweep_dir / LAUNCHER_DIR).mkdir(parents=True, exist_ok=True)
        shared, labels = split_shared([list(o) for o in job_overrides])
        if shared:  # said once: a job's own lines then name what differs
            print(f"effitrain: {len(labels)} jobs, each with: {' '.join(shared)}", flush=True)
        self.jobs = [
            self._prepare(list(o), initial_job_idx + i, labels[i]) for i, o in enumerate(job_overrides)
        ]
        self.gpu_groups, self.cpu_slots = job_slots(self.settings)
        self.stop_signal: int | None = None

    def _prepare(self, overrides: list, idx: int, label: str) -> LaunchedJob:
        config = self.launcher.hydra_context.config_loader.load_sweep_config(self.launcher.config, overrides)
        with open_dict(config):
            config.hydra.job.id = config.hydra.job.num = idx
        # as Hydra's BasicLauncher does: the job's subdir may read ${hydra:...}
        HydraConfig.instance().set_config(config)
        folder = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
        return LaunchedJob(idx, overrides, config, folder, os.path.relpath(folder, self.sweep_dir), label)

    def _decide_without_process(self, job: LaunchedJob) -> bool:
        """Settle a job that needs no process (outside the sweep folder, skipped, refused or in use)
        and say True; else False, with its folder locked (``job.lock``) until the job has ended."""
        sweep, target = self.sweep_dir.resolve(), job.folder.resolve()
        if target == sweep or not target.is_relative_to(sweep):
            error = (
                f"hydra.sweep.subdir={job.name!r} is invalid: a job folder must be inside the sweep folder "
                f"{self.sweep_dir} (overrides {' '.join(job.overrides)})"
            )
            job.outcome = JobOutcome(job.folder, "failed", False, error)
            return True
        with contextlib.ExitStack() as lock:
            decision = lock.enter_context(folder_policy.claimed(job.folder, job.config, job_of_sweep=True))
            if decision.action == "run":
                job.lock = lock.pop_all()
                return False
        if decision.action == "skip":
            job.value = decision.previous.get(job.config.get("optimized_metric", "eval/loss"))
            job.outcome, fields = JobOutcome(job.folder, "ok", True, None), {"skipped": True}
        elif decision.action == "refuse":
            reason = decision.reason
            job.outcome, fields = JobOutcome(job.folder, "failed", False, reason), {"error": reason}
        else:  # another sweep (or run) writes there now: it is left to that one
            error = f"in use by another sweep or run (pid {decision.owner}): left to it"
            job.outcome, fields = JobOutcome(job.folder, "busy", False, error), {"owner": decision.owner}
        self._record(job, status=job.outcome.status, **fields)
        return True

    def _start(self, job: LaunchedJob) -> None:
        import cloudpickle

        job.cpus, job.gpus = self.cpu_slots.pop(0), self.gpu_groups.pop(0) if self.gpu_groups else None
        # its spec (code, unpickled by its process) and its result in unnamed files: none another user
        # could plant or read, none left behind
        spec, job.result = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        state = {"task_function": self.launcher.task_function, "hydra_context": self.launcher.hydra_context}
        cloudpickle.dump({**state, "config": job.config, "singletons": Singleton.get_state()}, spec)
        spec.seek(0)
        env = dict(os.environ, **{folder_policy.LOCKED_ENV: str(job.folder.resolve())})
        if job.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = job.gpus
        if job.cpus is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(len(job.cpus))  # one thread per core
        # a job's process imports the same effitrain (and hydra_plugins) as the sweep, wherever started
        roots = [] if ROOT.name in ("site-packages", "dist-packages") else [str(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join(roots + [p for p in [env.get("PYTHONPATH")] if p])
        job.before = {name: file_id(job.folder / name) for name in (results.SUMMARY, results.METRICS)}
        setup = functools.partial(_in_the_job, job.cpus, os.getpid(), ctypes.CDLL(None).prctl)
        with open_no_follow(job.folder / JOB_LOG, "wb") as log, spec:
            job.started = time.time()
            job.deadline = job.started + self.settings["timeout_min"] * 60
            # its own session: a Ctrl-C at the terminal reaches the sweep only, which forwards it
            # once to every job (a job hit twice could be stopped while writing its summary)
            job.process = subprocess.Popen(
                [sys.executable, "-m", "effitrain.sweep.worker", str(job.result.fileno())], stdin=spec,
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=setup,
                pass_fds=[job.result.fileno()],
            )  # fmt: skip
        where = [f"pid {job.process.pid}"]
        where += [f"CUDA_VISIBLE_DEVICES={job.gpus}"] if job.gpus is not None else []
        where += [f"cpus {','.join(map(str, job.cpus))}"] if job.cpus is not None else []
        print(f"effitrain: job {job.idx} started ({', '.join(where)}): {job.label}", flush=True)

    def _send(self, job: LaunchedJob, signum: int) -> None:
        """``signum`` to a running job; SIGKILL to its process group (nothing it started outlives it)."""
        if job.process.poll() is not None:
            return
        job.stop_signal = job.stop_signal or signum
        job.deadline = time.time() + self.settings["kill_grace_s"]  # then SIGKILL
        if signum == signal.SIGKILL:  # unreaped (polled above): its group exists even if it just ended
            os.killpg(job.process.pid, signum)
        else:
            job.process.send_signal(signum)

    def _finish(self, job: LaunchedJob) -> None:
        """A job whose process has ended: how it ended, its slots back (to the back: every GPU gets used)."""
        with job.result:  # None when empty or cut short: its process ended before it wrote the result
            job.result.seek(0)
            code, result = job.process.returncode, results.json_object(job.result.read())
        job.outcome = outcome = job_outcome(job, code, result, self.settings["timeout_min"])
        job.lock.close()  # let go only after a killed job's summary is written under it
        self.cpu_slots.append(job.cpus)
        self.gpu_groups += [job.gpus] if job.gpus is not None else []
        job.value = (result or {}).get("return_value")  # None when the task raised
        ended = time.time()
        self._record(
            job, status=outcome.status, pid=job.process.pid, returncode=code, ended=ended, error=outcome.error
        )
        line = f"effitrain: job {job.idx} {outcome.status}: {job.label} ({ended - job.started:.1f} s)"
        print(line if outcome.status == "ok" else f"{line}: {outcome.error}", flush=True)

    def _stop(self, signum: int, running: list[LaunchedJob]) -> None:
        """The sweep's first signal to every running job; a second one as SIGKILL."""
        first = self.stop_signal is None
        if first:
            self.stop_signal = signum
            stopping = f"stopping {len(running)} running job(s), which record status interrupted"
            stopping += "; no new job starts (again to kill them at once)"
            print(f"\neffitrain: {signal_name(signum)}: {stopping}", file=sys.stderr, flush=True)
        for job in running:
            self._send(job, signum if first else signal.SIGKILL)

    def run(self) -> list:
        signals: list[int] = []  # acted on in the loop below, not inside the handler
        handlers = {
            s: signal.signal(s, lambda s, _: signals.append(s)) for s in (signal.SIGINT, signal.SIGTERM)
        }
        pending, running = list(self.jobs), []
        try:
            while running or (pending and self.stop_signal is None):
                while signals:
                    self._stop(signals.pop(0), running)
                for job in running:  # past timeout_min (SIGTERM), or past kill_grace_s after a signal
                    if job.process.poll() is None and time.time() > job.deadline:
                        job.timed_out = job.timed_out or job.stop_signal is None
                        self._send(job, signal.SIGTERM if job.stop_signal is None else signal.SIGKILL)
                for job in [job for job in running if job.process.poll() is not None]:
                    running.remove(job)
                    self._finish(job)
                while pending and self.cpu_slots and self.stop_signal is None:
                    job = pending.pop(0)
                    if not self._decide_without_process(job):
                        self._start(job)
                        running.append(job)
                time.sleep(0.05)
        finally:
            for job in running:  # only when the launcher itself fails: leave no job behind
                self._send(job, signal.SIGKILL)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        for job in pending:
            job.outcome = JobOutcome(job.folder, "not started", False, "the sweep was stopped first")
        RECORD.jobs = (RECORD.jobs or []) + [job.outcome for job in self.jobs]
        RECORD.signal = self.stop_signal if self.stop_signal is not None else RECORD.signal
        # COMPLETED also for a failed or killed job: the sweep reports it and goes on; Hydra's
        # sweeper would stop the whole multirun at the first FAILED with a traceback
        done = {"status": JobStatus.COMPLETED, "working_dir": os.getcwd()}
        return [job_return(job.overrides, job.config, job.value, **done) for job in self.jobs]

    def _record(self, job: LaunchedJob, **fields) -> None:
        """A line of ``<sweep>/.effitrain/launches.jsonl``: where and when each job ran."""
        line = {"job": job.idx, "folder": job.name}
        if job.process is not None:
            line.update(started=job.started, cuda_visible_devices=job.gpus, cpus=job.cpus)
        with open_no_follow(self.sweep_dir / LAUNCHER_DIR / LAUNCHES, "a") as handle:
            handle.write(json.dumps({**line, **fields}) + "\n")


def _in_the_job(cpus: list | None, sweep_pid: int, prctl) -> None:
    """In a job's process before it starts Python: its cores, and SIGTERM when the sweep's process dies
    however it dies (SIGKILL included), so a job never runs on as an orphan."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != sweep_pid:  # the sweep died before the line above
        os._exit(1)


def job_outcome(job: LaunchedJob, code: int, result: dict | None, timeout_min) -> JobOutcome:
    """How the job ended, from its exit and what it wrote; a job stopped before it could say so itself
    (killed outright, timed out) gets its status written into its summary here."""
    log, summary = job.folder / JOB_LOG, results.read_summary(job.folder)
    written = summary if file_id(job.folder / results.SUMMARY) != job.before[results.SUMMARY] else None
    said = written.get("status", "failed") if written is not None else None  # by this attempt's run
    signum = -code if code < 0 else None
    if said == "ok":
        return JobOutcome(job.folder, "ok", False, None, log)
    if job.timed_out:
        status, signum = "timeout", signum or job.stop_signal
        error = f"ran longer than hydra.launcher.timeout_min={timeout_min}: stopped by {signal_name(signum)}"
    elif job.stop_signal is not None and signum != signal.SIGKILL and written is None:
        # the sweep stopped it (Ctrl-C, SIGTERM) before it could say so itself (still starting)
        status, signum = "interrupted", job.stop_signal
        error = f"interrupted by {signal_name(signum)} (the sweep was stopped)"
    elif signum is not None and said != "interrupted":
        status, error = "killed", f"killed by {signal_name(signum)}"
        if signum == signal.SIGKILL and job.stop_signal is None:
            error += " (from outside: the kernel's OOM killer sends it when memory runs out)"
        elif signum == signal.SIGKILL:
            error += (
                f" after {signal_name(job.stop_signal)}: it did not stop within hydra.launcher.kill_grace_s"
            )
    elif said is not None:
        return JobOutcome(job.folder, said, False, written.get("error"), log)
    elif result is not None and not result.get("completed"):
        return JobOutcome(job.folder, "failed", False, result.get("error"), log)
    elif code == 0 and result is not None:
        # no new summary: an ok run that resume=auto kept, or a task that writes none
        summary = summary or {"status": "ok"}
        return JobOutcome(job.folder, summary.get("status", "failed"), False, summary.get("error"), log)
    else:
        error = f"its process exited with code {code} and no summary.json: see {log}"
        return JobOutcome(job.folder, "failed", False, error, log)
    if written is None:  # nothing of its own (an interrupted run's measurements): its keys and steps
        written = {"env/pid": job.process.pid, "env/cuda_visible_devices": job.gpus}
        written["env/cpu_affinity"] = job.cpus
        with contextlib.suppress(Exception):  # the keys are context; the status is written regardless
            written.update(summary_config_keys(job.config, job.folder, 1))
        if file_id(job.folder / results.METRICS) != job.before[results.METRICS]:
            steps = [r["step"] for r in read_metrics(job.folder / results.METRICS) if "train/loss" in r]
            written["train/steps"] = max(steps, default=0)
    results.write_json_atomic(
        job.folder / results.SUMMARY, {**written, "status": status, "error": error, "signal": int(signum)}
    )
    return JobOutcome(job.folder, status, False, error, log)


def split_shared(job_overrides: list[list[str]]) -> tuple[list[str], list[str]]:
    """The overrides every job of a sweep has (in the first job's order), and for each job what
    sets it apart (its overrides, space-separated; a lone job: all of them, or "the defaults")."""
    if len(job_overrides) < 2:
        return [], [" ".join(o) or "the defaults" for o in job_overrides]
    common = set.intersection(*(set(o) for o in job_overrides))
    shared = [o for o in job_overrides[0] if o in common]
    return shared, [" ".join(o for o in overrides if o not in common) for overrides in job_overrides]


def expose_launcher_plugin() -> None:
    """Let Hydra's plugin scan find effitrain's launcher in a source checkout or an editable install,
    whose finder hides ``hydra_plugins/effitrain_launcher`` (a wheel installs it beside the others)."""
    import hydra_plugins

    if str(ROOT / "hydra_plugins") not in hydra_plugins.__path__:
        hydra_plugins.__path__.append(str(ROOT / "hydra_plugins"))
