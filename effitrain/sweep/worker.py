"""One job of effitrain's launcher, in its own process: ``python -m effitrain.sweep.worker <spec>``.

The sweep's process (:mod:`effitrain.sweep.launcher`) pickles Hydra's task function, the job's config and
Hydra's state into ``<spec>``; this process pins itself to its cores, runs the job as Hydra's own
launchers do (``run_job``: the job folder, ``.hydra/``, logging, callbacks) and leaves a result file
for the sweep. Its stdout and stderr are the job's ``job.log``.
"""

from __future__ import annotations

import os
import sys


def _pin_to_cores() -> None:
    """The cores the launcher gave this job (torch's thread count follows OMP_NUM_THREADS)."""
    cpus = os.environ.get("EFFITRAIN_CPUS")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def _end_with_the_sweep() -> None:
    """SIGTERM this process when the sweep's process dies, however it dies (SIGKILL included):
    a job never runs on as an orphan. Linux only; elsewhere the sweep's own forwarding remains."""
    import ctypes
    import signal

    parent = os.environ.get("EFFITRAIN_LAUNCHER_PID")
    if parent is None or not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def main(spec_path: str) -> int:
    import signal

    # Until the task runs, Ctrl-C forwarded by the sweep ends this process outright, as SIGTERM
    # does: a KeyboardInterrupt raised in this start-up (imports, unpickling) could be caught on
    # its way out and the job would sleep on until the sweep's kill_grace_s ran out.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _pin_to_cores()
    _end_with_the_sweep()
    import pickle
    import traceback

    import cloudpickle  # noqa: F401  (registers what the spec's by-value functions need)
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job, setup_globals

    with open(spec_path, "rb") as handle:
        spec = pickle.load(handle)
    Singleton.set_state(spec["singletons"])
    setup_globals()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the run records Ctrl-C as interrupted
    job = run_job(
        hydra_context=spec["hydra_context"],
        task_function=spec["task_function"],
        config=spec["config"],
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
    completed = job.status == JobStatus.COMPLETED
    result = {"completed": completed, "return_value": job._return_value if completed else None}
    if not completed:  # the task raised: its traceback in job.log, its one line for the report
        error = job._return_value
        traceback.print_exception(type(error), error, error.__traceback__)
        result["error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"[:2000]
    try:
        payload = pickle.dumps(result)
    except Exception:  # a return value that cannot cross processes: the sweep gets its text
        result["return_value"] = repr(result["return_value"])
        payload = pickle.dumps(result)
    from effitrain.util.atomic import write_atomic

    write_atomic(spec["result"], payload)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
