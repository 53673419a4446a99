"""The job side of a multirun: what each job's process does before its run (under effitrain's
launcher and under ``submitit_slurm`` alike), called by the Hydra task (:mod:`effitrain.commands.front_door`)."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from effitrain.run import folders

# Inductor's compile cache, shared by a sweep's jobs: a dot-folder of the sweep.
INDUCTOR_CACHE = ".cache/inductor"


def start_job(cfg: DictConfig, hydra_cfg: DictConfig) -> dict | None:
    """Prepare one job of a multirun; return its earlier ok summary when it is to be skipped."""
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "RANK" not in os.environ:
        # submitit runs the job in each of its SLURM tasks (hydra.launcher.tasks_per_node): they
        # become the ranks of one job, with the variables torchrun would set
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    # Inductor's cache defaults to /tmp of each machine; under the sweep folder it is shared by all
    # jobs of the sweep, on one box or across cluster nodes, so later compile=on jobs start faster.
    cache = Path(hydra_cfg.sweep.dir).resolve() / INDUCTOR_CACHE
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
    decision = folders.decide(Path(hydra_cfg.runtime.output_dir), cfg, job_of_sweep=True)
    if decision.action != "skip":  # a refused one runs: the run itself refuses the folder, in its summary
        return None
    print(decision.reason)
    return decision.previous
