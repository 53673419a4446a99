"""A sweep's job in its own process: :func:`start_job`, what every job does before its run (under
effitrain's launcher and ``submitit_slurm`` alike), and ``python -m effitrain.sweep.worker <spec>``, the
process effitrain's launcher starts: it runs Hydra's ``run_job`` on ``<spec>`` (the task, the job's
config and Hydra's state, pickled by the sweep) and leaves its result as JSON.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from omegaconf import DictConfig

INDUCTOR_CACHE = (
    ".cache/inductor"  # Inductor's compile cache, shared by a sweep's jobs: a dot-folder of the sweep
)


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


def main(spec_path: str) -> int:
    # Until the task runs, Ctrl-C forwarded by the sweep ends this process outright, as SIGTERM
    # does: a KeyboardInterrupt raised in this start-up (imports, unpickling) could be caught on
    # its way out and the job would sleep on until the sweep's kill_grace_s ran out.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    folder, spec = os.stat(Path(spec_path).parent), os.stat(spec_path)
    if not (
        folder.st_uid == spec.st_uid == os.getuid() and not folder.st_mode & 0o077
    ):  # unpickling runs code
        print(
            f"effitrain: error: {spec_path} is not in a folder only this user may write: not read",
            file=sys.stderr,
        )
        return 2
    import json
    import traceback

    import cloudpickle
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job, setup_globals

    from effitrain.util.atomic import write_atomic

    with open(spec_path, "rb") as handle:
        spec = cloudpickle.load(handle)
    Singleton.set_state(spec["singletons"])
    setup_globals()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the run records Ctrl-C as interrupted
    task, config, context = spec["task_function"], spec["config"], spec["hydra_context"]
    job = run_job(task, config, "hydra.sweep.dir", "hydra.sweep.subdir", hydra_context=context)
    result = {"completed": job.status == JobStatus.COMPLETED, "return_value": job._return_value}
    if not result["completed"]:  # the task raised: its traceback in job.log, its one line for the report
        error = result.pop("return_value")
        traceback.print_exception(error)
        result["error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"[:2000]
    write_atomic(spec["result"], json.dumps(result, default=repr))  # a value JSON cannot hold: its text
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
