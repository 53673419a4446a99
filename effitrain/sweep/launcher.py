"""Multiruns: effitrain's launcher. Its settings and the GPU and CPU slots they make are
:mod:`effitrain.sweep.slots`, how a launched job ended :mod:`effitrain.sweep.outcome`; the job-side
preparation is :mod:`effitrain.sweep.job_start`, the closing report :mod:`effitrain.sweep.report`.

    python train.py sweep=optimizers max_steps=20      # a named study from multirun_sweeps/
    python train.py -m optimizer=adamw,adafactor       # a plain Hydra multirun gets the same
    python train.py -m optimizer=adamw,adafactor hydra.launcher.max_parallel=2   # two at once
    python train.py sweep=optimizers max_steps=20 hydra.sweep.dir=multirun/optimizers/<date_time>  # resume

The code runs in two places. In the sweep's process: :func:`launch_local` (``hydra/launcher:
effitrain``, the default) starts one process per job (``python -m effitrain.sweep.worker``),
``max_parallel`` at once, each with its own GPUs (``CUDA_VISIBLE_DEVICES``) or CPU cores, its
output in ``<job>/job.log``; it decides skips without starting a process, locks each job folder
while its job runs, records a job killed outright as ``killed``/``timeout`` and forwards Ctrl-C and
SIGTERM to every running job; :class:`effitrain.sweep.report.SweepReport` then says how each job
ended. In each job's process: :func:`effitrain.sweep.job_start.start_job` (also under ``submitit_slurm``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from effitrain.config.errors import ConfigError, fail
from effitrain.run import results
from effitrain.sweep.outcome import JOB_LOG, LaunchedJob, file_id, job_outcome
from effitrain.sweep.report import RECORD, JobOutcome, signal_name
from effitrain.sweep.slots import cpu_sets, launcher_settings, visible_gpus

# The launcher's bookkeeping lives in a dot-folder of the sweep.
LAUNCHER_DIR = ".effitrain"  # <sweep>/.effitrain: launches.jsonl, each running job's spec
LAUNCHES = "launches.jsonl"  # one line per job: folder, pid, devices, start and end, how it ended
# Set for a job's process: the folder its launcher holds locked for it (see results.folder_lock).
LOCKED_ENV = "EFFITRAIN_FOLDER_LOCKED"
CPUS_ENV = "EFFITRAIN_CPUS"  # the cores a job's process pins itself to
PARENT_ENV = "EFFITRAIN_LAUNCHER_PID"  # a job's process ends when this one dies


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
        self.running: list[LaunchedJob] = []
        self.stop_signal: int | None = None
        self._pending_signals: list[int] = []

    # -- preparing -----------------------------------------------------------------------------

    def _prepare(self, overrides: list, idx: int) -> LaunchedJob:
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
        return LaunchedJob(idx, overrides, config, folder, name)

    def _decide_without_process(self, job: LaunchedJob) -> bool:
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
        skip = (
            job.config.get("skip_ok_jobs", True) and previous is not None and previous.get("status") == "ok"
        )
        error = results.skip_refusal(job.folder, previous, job.config) if skip else None
        if error is not None:  # not done: it ran another config, which a run would not overwrite
            job.outcome = JobOutcome(job.folder, "failed", False, error)
            self._record(job, status="failed", error=error)
            return True
        if skip:
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

    def _start(self, job: LaunchedJob) -> None:
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
        job.summary_before = file_id(job.folder / results.SUMMARY)
        job.metrics_before = file_id(job.folder / results.METRICS)
        log = open(job.folder / JOB_LOG, "wb")
        job.started = time.time()
        with log:
            # its own session: a Ctrl-C at the terminal reaches the sweep only, which forwards it
            # once to every job (a job hit twice could be stopped while writing its summary)
            job.process = subprocess.Popen(
                [sys.executable, "-m", "effitrain.sweep.worker", str(spec)],
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
                    f"\neffitrain: {signal_name(signum)}: stopping {len(self.running)} running job(s), "
                    "which record status interrupted; no new job starts (again to kill them at once)",
                    file=sys.stderr,
                    flush=True,
                )
                for job in self.running:
                    self._send(job, signum, grace=True)
            else:
                for job in self.running:
                    self._send(job, signal.SIGKILL, grace=False)

    def _send(self, job: LaunchedJob, signum: int, grace: bool) -> None:
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

    def _finish(self, job: LaunchedJob, code: int) -> None:
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
            job.outcome = job_outcome(job, code, result, self.settings["timeout_min"])
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

    def _record(self, job: LaunchedJob, **fields) -> None:
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

    def _job_return(self, job: LaunchedJob):
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
