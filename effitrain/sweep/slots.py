"""The settings of effitrain's launcher (``hydra/launcher=effitrain``) and the slots they make: the
GPU groups handed to jobs (``CUDA_VISIBLE_DEVICES``) and one set of CPU cores per running job.

The settings are typed by :class:`effitrain.config.schema.LauncherConfig` in Hydra's ConfigStore (as
hydra_submitit_launcher types its own): ``conf/hydra/launcher/effitrain.yaml`` merges into it, so an
unknown key or a value of the wrong type fails while the config is composed.
:func:`launcher_settings` checks what a type cannot say, in one line each.
"""

from __future__ import annotations

import glob
import os
import sys

from omegaconf import OmegaConf

from effitrain.config.errors import ConfigError, invalid
from effitrain.config.schema import LauncherConfig

# What each typed setting accepts, in the words of the one-line error a wrong value gets.
ACCEPTS = {
    "max_parallel": "a whole number >= 1",
    "gpus_per_job": "a whole number >= 1",
    "cpu_pinning": "true or false",
}


def launcher_settings(params) -> dict:
    """``hydra.launcher``'s settings (Hydra's node, or a plain dict), typed by ``LauncherConfig``
    and checked.

    A value is typed as OmegaConf types it (``"2"`` is 2). ``devices``, ``timeout_min`` and
    ``kill_grace_s`` are checked here by hand: OmegaConf 2.3 has no Union type for "an id or a
    list" or "an int or a float", and a float field would show ``-1`` as ``-1.0`` in the message.

    Raises:
        ConfigError: an unknown key or a bad value (one line naming it).
    """
    from omegaconf.errors import ValidationError

    params = {
        k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
        for k, v in dict(params).items()
        if k != "_target_"
    }
    typed = OmegaConf.structured(LauncherConfig)
    known = [key for key in typed if key != "_target_"]
    unknown = sorted(set(params) - set(known))
    if unknown:  # OmegaConf's own message is several lines
        raise ConfigError(
            f"hydra.launcher.{unknown[0]} is not a setting of effitrain's launcher: use {', '.join(known)}"
        )
    for key, value in params.items():
        try:
            typed[key] = value
        except ValidationError:  # several lines too
            raise invalid(f"hydra.launcher.{key}", value, ACCEPTS[key]) from None
    settings = OmegaConf.to_container(typed)  # plain values: a list of devices, not a ListConfig
    del settings["_target_"]
    for key in ("max_parallel", "gpus_per_job"):
        if settings[key] < 1:
            raise invalid(f"hydra.launcher.{key}", settings[key], ACCEPTS[key])
    for key in ("timeout_min", "kill_grace_s"):
        if (
            not isinstance(settings[key], (int, float))
            or isinstance(settings[key], bool)
            or settings[key] <= 0
        ):
            raise invalid(f"hydra.launcher.{key}", settings[key], "a number > 0")
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
