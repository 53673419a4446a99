"""The settings of effitrain's launcher, their types and ranges declared once by
:class:`effitrain.config.schema.LauncherConfig`, and the slots they make: the GPU groups handed to jobs
(``CUDA_VISIBLE_DEVICES``) and one set of CPU cores per running job.
"""

from __future__ import annotations

import glob
import os
import sys

from omegaconf import OmegaConf

from effitrain.config.errors import ConfigError, invalid
from effitrain.config.schema import LauncherConfig, launcher_values


def launcher_settings(params) -> dict:
    """``hydra.launcher``'s settings (Hydra's node, or a plain dict), typed and checked.

    Raises:
        ConfigError: an unknown key or a bad value (one line naming it).
    """
    params = OmegaConf.to_container(OmegaConf.create(dict(params)), resolve=True)
    known = [key for key in LauncherConfig.__dataclass_fields__ if key != "_target_"]
    unknown = sorted(set(params) - set(known) - {"_target_"})
    if unknown:  # OmegaConf's own message is several lines
        raise ConfigError(
            f"hydra.launcher.{unknown[0]} is not a setting of effitrain's launcher: use {', '.join(known)}"
        )
    settings = launcher_values(params)
    if settings["devices"] is not None and len(settings["devices"]) < settings["gpus_per_job"]:
        allowed = f"at most the {len(settings['devices'])} devices of hydra.launcher.devices"
        raise invalid("hydra.launcher.gpus_per_job", settings["gpus_per_job"], allowed)
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
