"""The private APIs of OmegaConf and Hydra effitrain uses: a config's node as it is stored, a Hydra
job's result without its property's side effects.
"""

from __future__ import annotations

from effitrain.util.compat.guard import checked, missing, private


def config_node(cfg, key):
    """The node ``cfg`` stores under ``key`` (a DictConfig's key or a ListConfig's index) as it is:
    an interpolation unresolved, a missing value (``???``) without raising, a child config as a
    config (OmegaConf's ``_get_node``; ``cfg[key]`` resolves and raises). No fallback: the checks
    that walk a config cannot, so a missing one is an error."""
    get_node = private("omegaconf", cfg, "_get_node")
    if get_node is None:
        raise missing("omegaconf", "Container._get_node")
    return get_node(key)


def job_return_value(job):
    """What a Hydra job returned, or the exception it raised when it failed (``JobReturn``'s
    private ``_return_value``: its public ``return_value`` raises that exception and writes a line to
    stderr). Fallback: the public property, its exception caught and returned (and the line written)."""
    if checked("hydra-core") and hasattr(job, "_return_value"):
        return job._return_value
    try:
        return job.return_value
    except Exception as error:  # the job's own error, what _return_value held
        return error


def job_return(overrides, config, value, **fields):
    """A Hydra ``JobReturn`` for a job that returned (or raised) ``value``, with ``fields`` (status,
    working_dir, ...): the value set through the public setter, so that no caller names the private
    field the dataclass stores it in."""
    from hydra.core.utils import JobReturn

    job = JobReturn(overrides, config, **fields)
    job.return_value = value
    return job
