"""A sweep's job in its own process: :func:`start_job`, what every job does before its run (under
effitrain's launcher and ``submitit_slurm`` alike), and ``python -m effitrain.sweep.worker <spec>``,
the process effitrain's launcher starts: it reads ``<spec>`` (Hydra's task function, the job's config
and Hydra's state, pickled by the sweep's process in a folder only its user may write: unpickling
runs code), pins itself to its cores, runs the job as Hydra's own launchers do (``run_job``) and
leaves its result as JSON.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from omegaconf import DictConfig

# Inductor's compile cache, shared by a sweep's jobs: a dot-folder of the sweep.
INDUCTOR_CACHE = ".cache/inductor"


def start_job(cfg: DictConfig, hydra_cfg: DictConfig) -> dict | None:
    """Prepare one job of a multirun; return its earlier ok summary when it is to be skipped."""
    from effitrain.run import folders

    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "RANK" not in os.environ:
        # submitit runs the job in each of its SLURM tasks (hydra.launcher.tasks_per_node): they
        # become the ranks of one job, with the variables torchrun would set
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    # Inductor's cache defaults to /tmp of each machine; under the sweep folder it is shared by all
    # jobs of the sweep, on one box or across cluster nodes, so later compile=on jobs start faster.
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", str(Path(hydra_cfg.sweep.dir).resolve() / INDUCTOR_CACHE)
    )
    decision = folders.decide(Path(hydra_cfg.runtime.output_dir), cfg, job_of_sweep=True)
    if decision.action != "skip":  # a refused one runs: the run itself refuses the folder, in its summary
        return None
    print(decision.reason)
    return decision.previous


def private(path: Path) -> bool:
    """Whether ``path`` is this user's, in a folder of this user's that no one else may enter."""
    folder, file = os.stat(path.parent), os.stat(path)
    return folder.st_uid == file.st_uid == os.getuid() and not folder.st_mode & 0o077


def _end_with_the_sweep() -> None:
    """SIGTERM this process when the sweep's process dies, however it dies (SIGKILL included):
    a job never runs on as an orphan. Linux only; elsewhere the sweep's own forwarding remains."""
    import ctypes

    parent = os.environ.get("EFFITRAIN_LAUNCHER_PID")
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def main(spec_path: str) -> int:
    # Until the task runs, Ctrl-C forwarded by the sweep ends this process outright, as SIGTERM
    # does: a KeyboardInterrupt raised in this start-up (imports, unpickling) could be caught on
    # its way out and the job would sleep on until the sweep's kill_grace_s ran out.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if os.environ.get("EFFITRAIN_CPUS"):  # torch's thread count follows OMP_NUM_THREADS
        os.sched_setaffinity(0, {int(c) for c in os.environ["EFFITRAIN_CPUS"].split(",")})
    _end_with_the_sweep()
    if not private(Path(spec_path)):
        print(
            f"effitrain: error: {spec_path} is not in a folder only this user may write: not read",
            file=sys.stderr,
        )
        return 2
    import json
    import pickle
    import traceback

    import cloudpickle  # noqa: F401  (registers what the spec's by-value functions need)
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job, setup_globals

    from effitrain.util.atomic import write_atomic

    with open(spec_path, "rb") as handle:
        spec = pickle.load(handle)
    Singleton.set_state(spec["singletons"])
    setup_globals()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the run records Ctrl-C as interrupted
    task, config, context = spec["task_function"], spec["config"], spec["hydra_context"]
    job = run_job(task, config, "hydra.sweep.dir", "hydra.sweep.subdir", hydra_context=context)
    result = {"completed": job.status == JobStatus.COMPLETED}
    if result["completed"]:  # a value JSON cannot hold crosses as its text
        result["return_value"] = json.loads(json.dumps(job._return_value, default=repr))
    else:  # the task raised: its traceback in job.log, its one line for the report
        error = job._return_value
        traceback.print_exception(type(error), error, error.__traceback__)
        result["error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"[:2000]
    write_atomic(spec["result"], json.dumps(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
