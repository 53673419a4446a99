"""A sweep's job: :func:`start_job`, what it does before its run under any launcher, and the process
effitrain's launcher starts (``python -m effitrain.sweep.worker <fd>``), which runs Hydra's ``run_job``
on the pickled spec it reads from stdin and writes its result as JSON to the file ``fd``."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from omegaconf import DictConfig

INDUCTOR_CACHE = ".cache/inductor"  # Inductor's compile cache, shared by a sweep's jobs


def start_job(cfg: DictConfig, hydra_cfg: DictConfig) -> dict | None:
    """Prepare one job of a multirun; return its earlier ok summary when it is to be skipped."""
    from effitrain.run import folder_policy

    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "RANK" not in os.environ:
        # submitit runs the job in each of its SLURM tasks (hydra.launcher.tasks_per_node): they
        # become the ranks of one job, with the variables torchrun would set
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    # under the sweep folder, not each machine's /tmp: later compile=on jobs start faster, across nodes too
    cache = Path(hydra_cfg.sweep.dir).resolve() / INDUCTOR_CACHE
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
    decision = folder_policy.decide(Path(hydra_cfg.runtime.output_dir), cfg, job_of_sweep=True)
    if decision.action != "skip":  # a refused one runs: the run itself refuses the folder, in its summary
        return None
    print(decision.reason)
    return decision.previous


def main(result_fd: int) -> int:
    # Until the task runs, a forwarded Ctrl-C ends this process as SIGTERM does: a KeyboardInterrupt in
    # start-up (imports, unpickling) could be caught and the job sleep on until kill_grace_s ran out.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    import json
    import traceback

    import cloudpickle
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job, setup_globals

    from effitrain.util.compat import job_return_value
    from effitrain.util.interrupts import one_line

    spec = cloudpickle.load(sys.stdin.buffer)  # an unnamed file: only the launcher could write it
    Singleton.set_state(spec["singletons"])
    setup_globals()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the run records Ctrl-C as interrupted
    task, config, context = spec["task_function"], spec["config"], spec["hydra_context"]
    job = run_job(task, config, "hydra.sweep.dir", "hydra.sweep.subdir", hydra_context=context)
    result = {"completed": job.status == JobStatus.COMPLETED, "return_value": job_return_value(job)}
    if not result["completed"]:  # the task raised: its traceback in job.log, its one line for the report
        error = result.pop("return_value")
        traceback.print_exception(error)
        result["error"] = one_line(error)
    with open(result_fd, "w") as out:  # JSON, never a pickle: a value JSON cannot hold as its text
        json.dump(result, out, default=repr)
    return 0


if __name__ == "__main__":
    from effitrain.util.process_exit import run_then_end

    sys.exit(run_then_end(main, int(sys.argv[1])))
