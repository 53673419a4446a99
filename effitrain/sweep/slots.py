"""The slots effitrain's launcher hands its jobs, from its settings
(:func:`effitrain.config.schema.launcher_settings`): the GPU groups (``CUDA_VISIBLE_DEVICES``) and one
set of CPU cores per running job.
"""

from __future__ import annotations

import glob
import os
import sys


def job_slots(settings: dict) -> tuple[list[str], list[list[int] | None]]:
    """The GPU groups jobs take in turn, and a set of CPU cores per job that may run at once
    (``max_parallel``, or fewer where there are fewer GPU groups): a job starts while one is free."""
    devices, per_job = settings["devices"], settings["gpus_per_job"]
    devices = visible_gpus() if devices is None else devices
    groups = [",".join(devices[i : i + per_job]) for i in range(0, len(devices) - per_job + 1, per_job)]
    parallel = min(settings["max_parallel"], len(groups) or settings["max_parallel"])
    return groups, cpu_sets(parallel, settings["cpu_pinning"])


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
