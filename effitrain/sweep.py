"""Multiruns: effitrain's launcher, the job-side preparation and the closing report.

    python train.py sweep=optimizers max_steps=20      # a named study from multirun_sweeps/
    python train.py -m optimizer=adamw,adafactor       # a plain Hydra multirun gets the same
    python train.py -m optimizer=adamw,adafactor hydra.launcher.max_parallel=2   # two at once
    python train.py sweep=optimizers max_steps=20 hydra.sweep.dir=multirun/optimizers/<date_time>  # resume

The code runs in two places. In the sweep's process: :func:`launch_local` (``hydra/launcher:
effitrain``, the default) starts one process per job (``python -m effitrain.launcher_job``),
``max_parallel`` at once, each with its own GPUs (``CUDA_VISIBLE_DEVICES``) or CPU cores, its
output in ``<job>/job.log``; it decides skips without starting a process, locks each job folder
while its job runs, records a job killed outright as ``killed``/``timeout`` and forwards Ctrl-C and
SIGTERM to every running job; :class:`SweepReport` then says how each job ended. In each job's
process: :func:`start_job` (also under ``submitit_slurm``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from effitrain import results
from effitrain.config import ConfigError, invalid

# The launcher's bookkeeping and the shared caches live in dot-folders of the sweep.
INDUCTOR_CACHE = ".cache/inductor"
LAUNCHER_DIR = ".effitrain"  # <sweep>/.effitrain: launches.jsonl, each running job's spec
LAUNCHES = "launches.jsonl"  # one line per job: folder, pid, devices, start and end, how it ended
JOB_LOG = "job.log"  # a job's stdout and stderr, in its own folder
# Set for a job's process: the folder its launcher holds locked for it (see results.folder_lock).
LOCKED_ENV = "EFFITRAIN_FOLDER_LOCKED"
CPUS_ENV = "EFFITRAIN_CPUS"  # the cores a job's process pins itself to
PARENT_ENV = "EFFITRAIN_LAUNCHER_PID"  # a job's process ends when this one dies

LAUNCHER_DEFAULTS = {
    "max_parallel": 1,
    "devices": None,
    "gpus_per_job": 1,
    "cpu_pinning": True,
    "timeout_min": 1440,
    "kill_grace_s": 30,
}


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
    if results.config_change(previous, cfg) is not None:  # another config: the run refuses the folder
        return None
    print(
        f"effitrain: skip: {hydra_cfg.runtime.output_dir} already holds an ok summary.json (skip_ok_jobs=true)"
    )
    return previous


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
    """What effitrain's launcher did in this process, for :class:`SweepReport`: every job Hydra
    handed it, in order, and the signal that stopped the sweep, if one did."""

    launched: bool = False
    jobs: list[JobOutcome] = field(default_factory=list)
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


# ---------------------------------------------------------------------------------------------
# The launcher (runs in the sweep's process)


def launcher_settings(params) -> dict:
    """``hydra.launcher``'s settings, checked.

    Raises:
        ConfigError: an unknown key or a bad value (one line naming it).
    """
    params = {
        k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
        for k, v in dict(params).items()
        if k != "_target_"
    }
    unknown = sorted(set(params) - set(LAUNCHER_DEFAULTS))
    if unknown:
        known = ", ".join(LAUNCHER_DEFAULTS)
        raise ConfigError(
            f"hydra.launcher.{unknown[0]} is not a setting of effitrain's launcher: use {known}"
        )
    settings = {**LAUNCHER_DEFAULTS, **params}
    for key in ("max_parallel", "gpus_per_job"):
        if not isinstance(settings[key], int) or isinstance(settings[key], bool) or settings[key] < 1:
            raise invalid(f"hydra.launcher.{key}", settings[key], "a whole number >= 1")
    for key in ("timeout_min", "kill_grace_s"):
        if (
            not isinstance(settings[key], (int, float))
            or isinstance(settings[key], bool)
            or settings[key] <= 0
        ):
            raise invalid(f"hydra.launcher.{key}", settings[key], "a number > 0")
    if not isinstance(settings["cpu_pinning"], bool):
        raise invalid("hydra.launcher.cpu_pinning", settings["cpu_pinning"], "true or false")
    devices = settings["devices"]
    if devices is not None:
        if isinstance(devices, (int, str)):
            devices = [devices]
        if not isinstance(devices, list) or not devices or len(set(map(str, devices))) != len(devices):
            raise invalid(
                "hydra.launcher.devices", settings["devices"], "a list of distinct GPU ids, e.g. [0,1]"
            )
        settings["devices"] = [str(d) for d in devices]
        if len(devices) < settings["gpus_per_job"]:
            raise invalid(
                "hydra.launcher.gpus_per_job",
                settings["gpus_per_job"],
                f"at most the {len(devices)} devices of hydra.launcher.devices",
            )
    return settings


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` as given, else every one torch sees."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip() and not d.strip().startswith("-")]
    if "torch" not in sys.modules and not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")):
        return []  # no GPU device files: not worth importing torch (seconds) to count none
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def cpu_sets(parallel: int, pinning: bool) -> list[list[int] | None]:
    """One set of cores per concurrently running job: disjoint while there are enough cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if parallel == 1 or not pinning:
        return [None] * parallel
    if len(cpus) < parallel:  # more jobs than cores: one core each, shared round-robin
        return [[cpus[i % len(cpus)]] for i in range(parallel)]
    share = len(cpus) // parallel
    return [cpus[i * share : (i + 1) * share] for i in range(parallel)]


def _file_id(path: Path):
    """What tells a file rewritten by the job (an atomic write makes a new inode) from the old one."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass
class _Job:
    idx: int
    overrides: list
    config: DictConfig
    folder: Path
    name: str  # the folder relative to the sweep's
    lock: contextlib.ExitStack | None = None
    process: subprocess.Popen | None = None
    slot: int | None = None
    gpus: list | None = None
    cpus: list | None = None
    started: float = 0.0
    summary_before: tuple | None = None
    metrics_before: tuple | None = None
    stop_signal: int | None = None  # what the launcher sent it (a timeout or the sweep's stop)
    kill_at: float | None = None
    timed_out: bool = False
    outcome: JobOutcome | None = None
    value: object = None


class LocalSweep:
    """One batch of jobs on this machine: start, watch, stop and record them."""

    def __init__(self, launcher, job_overrides, initial_job_idx: int):
        from hydra.core.utils import configure_log, setup_globals

        setup_globals()
        configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
        self.launcher = launcher
        try:
            self.settings = launcher_settings(launcher.params)
        except ConfigError as error:
            from effitrain.hydra_task import fail

            fail(str(error))
        self.sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        (self.sweep_dir / LAUNCHER_DIR).mkdir(exist_ok=True)
        self.jobs = [self._prepare(list(o), initial_job_idx + i) for i, o in enumerate(job_overrides)]
        devices = self.settings["devices"]
        devices = visible_gpus() if devices is None else devices
        per_job = self.settings["gpus_per_job"]
        groups = [devices[i : i + per_job] for i in range(0, len(devices) - per_job + 1, per_job)]
        self.gpu_pool = deque(groups)  # freed groups go to the back, so every GPU gets used
        self.parallel = (
            min(self.settings["max_parallel"], len(groups)) if groups else self.settings["max_parallel"]
        )
        self.cpu_slots = cpu_sets(self.parallel, self.settings["cpu_pinning"])
        self.free_slots = deque(range(self.parallel))
        self.running: list[_Job] = []
        self.stop_signal: int | None = None
        self._pending_signals: list[int] = []

    # -- preparing -----------------------------------------------------------------------------

    def _prepare(self, overrides: list, idx: int) -> _Job:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import open_dict

        launcher = self.launcher
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
        with open_dict(config):
            config.hydra.job.id = idx
            config.hydra.job.num = idx
        # the folder Hydra's run_job will give the job (its subdir may read ${hydra:...})
        previous = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(config)
        try:
            folder = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
        finally:
            HydraConfig.instance().cfg = previous
        name = os.path.relpath(folder, self.sweep_dir)
        return _Job(idx, overrides, config, folder, name)

    def _decide_without_process(self, job: _Job) -> bool:
        """Settle a job that needs no process: outside the sweep folder, already ok, or in use."""
        sweep = self.sweep_dir.resolve()
        target = job.folder.resolve()
        if target == sweep or sweep not in target.parents:
            error = (
                f"hydra.sweep.subdir={job.name!r} is invalid: a job folder must be inside the sweep folder "
                f"{self.sweep_dir} (overrides {' '.join(job.overrides)})"
            )
            job.outcome = JobOutcome(job.folder, "failed", False, error)
            return True
        previous = results.read_summary(job.folder)
        if job.config.get("skip_ok_jobs", True) and previous is not None and previous.get("status") == "ok":
            job.outcome = JobOutcome(job.folder, "ok", True, None)
            job.value = previous.get(job.config.get("optimized_metric", "eval/loss"))
            self._record(job, status="ok", skipped=True)
            return True
        job.lock = contextlib.ExitStack()
        owner = job.lock.enter_context(results.folder_lock(job.folder))
        if owner is not None:  # another sweep (or run) writes there now: it is left to that one
            job.lock.close()
            job.lock = None
            error = f"in use by another sweep or run (pid {owner}): left to it"
            job.outcome = JobOutcome(job.folder, "busy", False, error)
            self._record(job, status="busy", owner=owner)
            return True
        return False

    # -- starting ------------------------------------------------------------------------------

    def _start(self, job: _Job) -> None:
        import cloudpickle
        from hydra.core.singleton import Singleton

        job.slot = self.free_slots.popleft()
        job.gpus = self.gpu_pool.popleft() if self.gpu_pool else None
        job.cpus = self.cpu_slots[job.slot]
        spec = self.sweep_dir / LAUNCHER_DIR / f"job-{job.idx}.pkl"
        result = self.sweep_dir / LAUNCHER_DIR / f"job-{job.idx}.result"
        result.unlink(missing_ok=True)
        with open(spec, "wb") as handle:
            cloudpickle.dump(
                {
                    "task_function": self.launcher.task_function,
                    "hydra_context": self.launcher.hydra_context,
                    "config": job.config,
                    "singletons": Singleton.get_state(),
                    "result": str(result),
                },
                handle,
            )
        env = dict(os.environ)
        env[LOCKED_ENV] = str(job.folder.resolve())
        env[PARENT_ENV] = str(os.getpid())
        if job.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(job.gpus)
        if job.cpus is not None:
            env[CPUS_ENV] = ",".join(map(str, job.cpus))
            threads = str(len(job.cpus))  # torch's intra-op pool: one thread per core of its own
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = threads
        env["PYTHONPATH"] = os.pathsep.join(_import_roots() + [p for p in [env.get("PYTHONPATH")] if p])
        job.summary_before = _file_id(job.folder / results.SUMMARY)
        job.metrics_before = _file_id(job.folder / results.METRICS)
        log = open(job.folder / JOB_LOG, "wb")
        job.started = time.time()
        with log:
            # its own session: a Ctrl-C at the terminal reaches the sweep only, which forwards it
            # once to every job (a job hit twice could be stopped while writing its summary)
            job.process = subprocess.Popen(
                [sys.executable, "-m", "effitrain.launcher_job", str(spec)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        where = []
        if job.gpus is not None:
            where.append(f"CUDA_VISIBLE_DEVICES={','.join(job.gpus)}")
        if job.cpus is not None:
            where.append(f"cpus {','.join(map(str, job.cpus))}")
        where = f"pid {job.process.pid}" + "".join(f", {w}" for w in where)
        print(f"effitrain: job {job.idx} started ({where}): {job.name}", flush=True)
        self.running.append(job)

    # -- watching ------------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        self._pending_signals.append(signum)  # acted on in the loop, not inside the handler

    def _handle_signals(self) -> None:
        while self._pending_signals:
            signum = self._pending_signals.pop(0)
            if self.stop_signal is None:
                self.stop_signal = signum
                print(
                    f"\neffitrain: {_signal_name(signum)}: stopping {len(self.running)} running job(s), "
                    "which record status interrupted; no new job starts (again to kill them at once)",
                    file=sys.stderr,
                    flush=True,
                )
                for job in self.running:
                    self._send(job, signum, grace=True)
            else:
                for job in self.running:
                    self._send(job, signal.SIGKILL, grace=False)

    def _send(self, job: _Job, signum: int, grace: bool) -> None:
        if job.process.poll() is not None:
            return
        job.stop_signal = job.stop_signal or signum
        try:
            if signum == signal.SIGKILL:  # its whole process group: nothing it started outlives it
                os.killpg(job.process.pid, signal.SIGKILL)
            else:
                os.kill(job.process.pid, signum)
        except ProcessLookupError:
            return
        if grace:
            job.kill_at = time.time() + self.settings["kill_grace_s"]

    def _watch(self) -> None:
        now = time.time()
        timeout_s = self.settings["timeout_min"] * 60
        for job in list(self.running):
            code = job.process.poll()
            if code is not None:
                self._finish(job, code)
                continue
            if not job.timed_out and now - job.started > timeout_s:
                job.timed_out = True
                self._send(job, signal.SIGTERM, grace=True)
            elif job.kill_at is not None and now > job.kill_at:
                job.kill_at = None
                self._send(job, signal.SIGKILL, grace=False)

    def run(self) -> list:
        queue = deque(self.jobs)
        handlers = {}
        if _in_main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                handlers[signum] = signal.signal(signum, self._on_signal)
        try:
            while queue or self.running:
                self._handle_signals()
                # a free slot always has free GPUs: there are at most as many slots as GPU groups
                while queue and self.stop_signal is None and self.free_slots:
                    job = queue.popleft()
                    if not self._decide_without_process(job):
                        self._start(job)
                if self.stop_signal is not None:
                    for job in queue:
                        job.outcome = JobOutcome(
                            job.folder, "not started", False, "the sweep was stopped first"
                        )
                    queue.clear()
                self._watch()
                if self.running:
                    time.sleep(0.05)
        finally:
            for job in self.running:  # only when the launcher itself fails: leave no job behind
                self._send(job, signal.SIGKILL, grace=False)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        RECORD.launched = True
        RECORD.jobs += [job.outcome for job in self.jobs]
        if self.stop_signal is not None:
            RECORD.signal = self.stop_signal
        return [self._job_return(job) for job in self.jobs]

    # -- finishing -----------------------------------------------------------------------------

    def _finish(self, job: _Job, code: int) -> None:
        self.running.remove(job)
        self.free_slots.append(job.slot)
        if job.gpus is not None:
            self.gpu_pool.append(job.gpus)
        ended = time.time()
        result_path = self.sweep_dir / LAUNCHER_DIR / f"job-{job.idx}.result"
        result = None
        if result_path.exists():
            import pickle

            with open(result_path, "rb") as handle:
                result = pickle.load(handle)
        (self.sweep_dir / LAUNCHER_DIR / f"job-{job.idx}.pkl").unlink(missing_ok=True)
        result_path.unlink(missing_ok=True)
        try:
            job.outcome = self._outcome(job, code, result)
        finally:
            if job.lock is not None:  # released only now: the killed record is written under it
                job.lock.close()
        outcome = job.outcome
        if result is not None and result.get("completed"):
            job.value = result.get("return_value")
        self._record(job, status=outcome.status, pid=job.process.pid, returncode=code, ended=ended,
                     error=outcome.error)  # fmt: skip
        line = f"effitrain: job {job.idx} {outcome.status}: {job.name} ({ended - job.started:.1f} s)"
        print(line if outcome.status == "ok" else f"{line}: {outcome.error}", flush=True)

    def _outcome(self, job: _Job, code: int, result: dict | None) -> JobOutcome:
        """How the job ended, from its exit and what it wrote; a job that could not write its own
        summary (killed outright, timed out) gets one written here."""
        log = job.folder / JOB_LOG
        summary_path = job.folder / results.SUMMARY
        written = _file_id(summary_path) != job.summary_before  # by this attempt
        summary = results.read_summary(job.folder) if summary_path.exists() else None
        if written and summary is not None and summary.get("status") == "ok":
            return JobOutcome(job.folder, "ok", False, None, log)
        signum = -code if code < 0 else None
        if job.timed_out:
            how = _signal_name(signum or job.stop_signal)
            error = (
                f"ran longer than hydra.launcher.timeout_min={self.settings['timeout_min']}: stopped by {how}"
            )
            self._write_stopped(
                job, "timeout", signum or job.stop_signal, error, summary if written else None
            )
            return JobOutcome(job.folder, "timeout", False, error, log)
        if job.stop_signal is not None and signum != signal.SIGKILL and not written:
            # the sweep stopped it (Ctrl-C, SIGTERM) before it could say so itself (still starting)
            error = f"interrupted by {_signal_name(job.stop_signal)} (the sweep was stopped)"
            self._write_stopped(job, "interrupted", job.stop_signal, error, None)
            return JobOutcome(job.folder, "interrupted", False, error, log)
        if signum is not None and not (
            written and summary is not None and summary.get("status") == "interrupted"
        ):
            error = f"killed by {_signal_name(signum)}"
            if signum == signal.SIGKILL and job.stop_signal is None:
                error += " (from outside: the kernel's OOM killer sends it when memory runs out)"
            elif signum == signal.SIGKILL:
                error += f" after {_signal_name(job.stop_signal)}: it did not stop within hydra.launcher.kill_grace_s"
            self._write_stopped(job, "killed", signum, error, summary if written else None)
            return JobOutcome(job.folder, "killed", False, error, log)
        if written and summary is not None:
            return JobOutcome(job.folder, summary.get("status", "failed"), False, summary.get("error"), log)
        if result is not None and not result.get("completed"):
            return JobOutcome(job.folder, "failed", False, result.get("error"), log)
        if code == 0 and result is not None:
            # the task wrote no new summary: a finished run resume=auto kept, or a task that writes none
            status = summary.get("status", "failed") if summary else "ok"
            return JobOutcome(job.folder, status, False, summary.get("error") if summary else None, log)
        error = f"its process exited with code {code} and no summary.json: see {log}"
        return JobOutcome(job.folder, "failed", False, error, log)

    def _write_stopped(self, job: _Job, status: str, signum: int, error: str, summary: dict | None) -> None:
        """The summary of a job stopped from outside: what it wrote itself, if anything (an
        interrupted run's measurements), else its config keys and the steps its metrics show."""
        if summary is None:
            summary = {}
            try:
                from effitrain.config import summary_config_keys

                summary.update(summary_config_keys(job.config, job.folder, 1))
            except Exception:  # the keys are context; the status must be written regardless
                pass
            if _file_id(job.folder / results.METRICS) != job.metrics_before:
                steps = [
                    r["step"] for r in results.read_metrics(job.folder / results.METRICS) if "train/loss" in r
                ]
                summary["train/steps"] = max(steps, default=0)
            summary["env/pid"] = job.process.pid
            summary["env/cuda_visible_devices"] = ",".join(job.gpus) if job.gpus is not None else None
            summary["env/cpu_affinity"] = job.cpus
        summary.update({"status": status, "error": error, "signal": int(signum)})
        results.write_json_atomic(job.folder / results.SUMMARY, summary)

    def _record(self, job: _Job, **fields) -> None:
        """A line of ``<sweep>/.effitrain/launches.jsonl``: where and when each job ran."""
        line = {"job": job.idx, "folder": job.name}
        if job.process is not None:
            line.update(
                started=job.started,
                cuda_visible_devices=",".join(job.gpus) if job.gpus is not None else None,
                cpus=job.cpus,
            )
        line.update(fields)
        with open(self.sweep_dir / LAUNCHER_DIR / LAUNCHES, "a") as handle:
            handle.write(json.dumps(line) + "\n")

    def _job_return(self, job: _Job):
        from hydra.core.utils import JobReturn, JobStatus

        ret = JobReturn()
        ret.overrides = job.overrides
        ret.cfg = job.config
        ret.working_dir = os.getcwd()
        ret.task_name = str(job.config.hydra.job.name)
        # COMPLETED also for a failed or killed job: the sweep reports it and goes on; Hydra's
        # sweeper would stop the whole multirun at the first FAILED with a traceback
        ret.status = JobStatus.COMPLETED
        ret.return_value = job.value
        return ret


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _import_roots() -> list[str]:
    """Where this process found effitrain, when that is a source checkout: a job's process then
    imports the same effitrain (and hydra_plugins) as the sweep, wherever it was started."""
    root = Path(__file__).resolve().parent.parent
    if root.name in ("site-packages", "dist-packages"):
        return []
    return [str(root)]


def expose_launcher_plugin() -> None:
    """Let Hydra's plugin discovery find effitrain's launcher also in a source checkout or an
    editable install, whose finder hides ``hydra_plugins/effitrain_launcher`` from the namespace
    scan (a wheel installs it beside the other plugins, where it is found anyway)."""
    import hydra_plugins

    folder = str(Path(__file__).resolve().parent.parent / "hydra_plugins")
    if os.path.isdir(os.path.join(folder, "effitrain_launcher")) and folder not in list(
        hydra_plugins.__path__
    ):
        hydra_plugins.__path__.append(folder)


def launch_local(launcher, job_overrides, initial_job_idx: int) -> list:
    """``EffitrainLauncher.launch``: run the batch, return one JobReturn per job, in order."""
    return LocalSweep(launcher, job_overrides, initial_job_idx).run()


# ---------------------------------------------------------------------------------------------
# The closing report (runs in the sweep's process)


class SweepReport(Callback):
    """Hydra callback (``hydra.callbacks.sweep_report``): after a multirun, report every job and
    exit with status 1 when any is not ok (128 + the signal when the sweep was stopped), so
    scripts and CI see it."""

    def __init__(self) -> None:
        self.started = time.time()

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.started = time.time()
        RECORD.launched, RECORD.jobs, RECORD.signal = False, [], None

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if RECORD.launched:  # effitrain's launcher: the jobs Hydra handed it, whatever is on disk
            outcomes = [_recheck(job) for job in RECORD.jobs]
        else:
            outcomes = sweep_outcomes(sweep_dir, self.started)
        for job in outcomes:
            how = "ok (skipped: ok before)" if job.skipped else job.status
            line = f"effitrain: {how}: {os.path.relpath(job.folder, sweep_dir)}"
            if job.status != "ok":
                line += f": {job.error}"
            if job.log is not None and job.log.exists():
                line += f" (log: {job.log})"
            print(line)
        busy = sum(job.status == "busy" for job in outcomes)
        not_started = sum(job.status == "not started" for job in outcomes)
        failed = sum(job.status not in ("ok", "busy", "not started") for job in outcomes)
        skipped = sum(job.skipped for job in outcomes)
        notes = [f"{skipped} skipped: ok before"]
        if busy:
            notes.append(f"{busy} in use by another sweep, not run")
        if not_started:
            notes.append(f"{not_started} not started")
        print(f"effitrain: {failed} of {len(outcomes)} jobs failed ({', '.join(notes)}) in {sweep_dir}")
        print(f"effitrain: compare: effitrain compare {shlex.quote(str(sweep_dir))}")
        failed += busy + not_started  # not done by this sweep either: the exit status says so
        if failed:
            args = [arg for arg in sys.argv if not arg.startswith("hydra.sweep.dir=")]
            resume = shlex.join(["python", *args, f"hydra.sweep.dir={sweep_dir}"])
            print(f"effitrain: rerun the jobs that are not ok: {resume}")
        sys.stdout.flush()
        if RECORD.signal is not None:
            print(
                f"effitrain: error: the sweep was stopped by {_signal_name(RECORD.signal)}", file=sys.stderr
            )
            sys.exit(128 + RECORD.signal)
        if failed:
            sys.exit(1)


def _recheck(job: JobOutcome) -> JobOutcome:
    """A job left to another sweep is reported as that sweep left it, if it has finished."""
    if job.status != "busy":
        return job
    summary = results.read_summary(job.folder)
    if summary is not None and summary.get("status") == "ok":
        return JobOutcome(job.folder, "ok", False, None)
    return job
