"""Validation: every check of a composed run config, in one place, before anything heavy is
loaded (:func:`validate`), and the checks of output folders made before Hydra writes one.

Each key's type and range is the schema's (:mod:`effitrain.config.schema`); what stays here are the
checks across keys and objects: the effective batch against accumulation, the precision and compile
backend against this machine, the model against the task and its positions, every target against
its group's allow-list and its signature, the optimizer built from the values, local files; the model
and its adapter built on ``meta`` by the check its builder hands in (``builds``). Every error a user can cause is a :class:`ConfigError` whose message is one line naming
the key, the bad value and what is allowed; :func:`validate` reports every problem of a config at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from effitrain.config.compose import command_line_overrides
from effitrain.config.data_files import check_data_files
from effitrain.config.errors import ConfigError, ConfigErrors, chosen, invalid, raise_problems
from effitrain.config.parallel import check_parallel
from effitrain.config.schema import SyntheticData, group_settings, range_problems
from effitrain.config.targets import (
    check_config_overrides,
    check_max_length,
    check_model,
    check_named_is_built,
    check_optimizer,
    check_targets,
    check_task_model,
    check_weights,
)
from effitrain.util.atomic import probe_write
from effitrain.util.compat import config_node
from effitrain.util.links import link_refusal


def check_output_overrides(overrides: list[str]) -> None:
    """Reject a ``hydra.run.dir`` / ``hydra.sweep.dir`` that could not be written, before Hydra
    creates it and fails with a traceback.

    Raises:
        ConfigError: the folder (or its nearest existing parent) is not a writable folder.
    """
    from effitrain.config.overrides import parse, values

    for override in parse(overrides):
        key = override.key_or_group
        if (
            key not in ("hydra.run.dir", "hydra.sweep.dir")
            or override.is_sweep_override()
            or override.is_delete()
        ):
            continue  # a deletion is composition's to refuse
        check_output_folder(key, values(override)[0])


def check_output_folder(key: str, value: str) -> None:
    """ConfigError when the folder ``value`` (or its nearest existing parent) could not be written."""
    if "${" in value:
        return
    path = Path(value).expanduser().absolute()

    def exists(candidate: Path) -> bool:
        try:
            return candidate.exists()
        except OSError:  # a name too long for the file system: not there
            return False

    existing = next(p for p in (path, *path.parents) if exists(p))
    try:
        longest = os.pathconf(existing if existing.is_dir() else existing.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    for part in path.relative_to(existing).parts:
        if "\0" in part or len(part.encode()) > longest:
            raise invalid(key, value, f"the folder name {part[:40]!r}... is not one this file system takes "
                                      f"(at most {longest} bytes, no NUL): give a shorter name")  # fmt: skip
    if not existing.is_dir():
        raise invalid(key, value, f"{existing} is a file, not a folder")
    if existing == path and (refusal := link_refusal(key, path)) is not None:
        raise ConfigError(refusal)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise invalid(key, value, f"{existing} cannot be written")
    try:
        probe_write(existing)  # a full disk: refused here, before Hydra writes its record
    except OSError as error:
        raise invalid(key, value, f"{existing} cannot be written ({error.strerror})") from None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _collect(checks) -> list[str]:
    problems = []
    for check in checks:
        try:
            check()
        except ConfigErrors as errors:
            problems += errors.problems
        except ConfigError as error:
            problems.append(str(error))
    return problems


def validate(cfg: DictConfig, world_size: int = 1, device: str | None = None, loads: bool = True,
             builds: Callable[[DictConfig], None] | None = None) -> None:  # fmt: skip
    """Check a composed run config before any data or model is loaded.

    Every check runs, so a user sees all problems at once. ``world_size`` is the number of
    data-parallel processes (the effective batch spans them all). ``device``: the device the config
    is checked for (``cpu`` or ``cuda``; None: this machine's, as a run has). ``loads``: the command
    loads the data and the weights (a run, ``check``); ``estimate`` and ``plan`` build the model on
    ``meta`` from the config alone, so their data's files and the weights are not checked. ``builds``:
    the check that builds the model and its adapter on ``meta``
    (:func:`effitrain.train.adapters.build.check_builds`, which needs torch and peft, so this layer
    is handed it), run last; the front door and a run pass it, ``estimate`` and ``plan`` build by
    the same function, which refuses the same values in the same line.

    Raises:
        ConfigError: one problem; ConfigErrors (a ConfigError) for several, one line each.
    """
    _assets(cfg, ("data", "model") if loads else ("model",))  # every check below reads these values
    problems = _collect(
        [
            lambda: _missing_values(cfg),
            lambda: _switches(cfg),
            lambda: raise_problems(range_problems(cfg)),  # each key's type and range, from the schema
            lambda: _synthetic_words(cfg),
            lambda: _effective_batch(cfg, world_size),
            lambda: _resume(cfg),
            lambda: _precision(cfg, device),
            lambda: _compile(cfg),
            lambda: check_parallel(cfg, device),
            lambda: check_model(cfg),
            lambda: check_named_is_built(cfg),
            lambda: check_targets(cfg),  # every group's target allowed, its keys against its arguments
        ]
    )
    if not problems:  # these build things from the values above, which must be sane first
        problems = _collect(
            [
                lambda: check_optimizer(cfg),
                lambda: check_config_overrides(cfg),
                lambda: check_task_model(cfg),
                lambda: check_max_length(cfg),
                *([lambda: check_data_files(cfg)] if loads else []),
            ]
        )
    if not problems:  # after the model's type is known to fit the task: the most specific first
        problems = _collect(
            [*([lambda: builds(cfg)] if builds else []), *([lambda: check_weights(cfg)] if loads else [])]
        )
    raise_problems(problems)


def _assets(cfg: DictConfig, groups: tuple[str, ...]) -> None:
    """The ``groups``' nodes (``data``, ``model``) resolve: a file of a package that is not installed
    (``${effitrain.asset:...}``) is one line naming the key, not a traceback from deep inside a run."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    for group in groups:
        try:
            OmegaConf.to_container(cfg[group], resolve=True)
        except InterpolationResolutionError as error:
            raw = OmegaConf.to_container(cfg, resolve=False)
            for part in str(error.full_key).split("."):
                raw = raw.get(part) if isinstance(raw, dict) else None
            reason = str(error).splitlines()[0].split("interpolation: ", 1)[-1]
            raise invalid(error.full_key, raw, reason) from None


def _synthetic_words(cfg: DictConfig) -> None:
    """``data=synthetic``: the shortest text no longer than the longest (each in range: the schema's)."""
    data = cfg.get("data")
    if data is None or group_settings("data", str(data.get("_target_", ""))) is not SyntheticData:
        return
    minimum, words = data.get("min_words_per_text"), data.get("words_per_text")
    numbers = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (minimum, words))
    if numbers and minimum > words:
        raise invalid("data.min_words_per_text", minimum, f"must be at most words_per_text = {words}")


def _missing_values(cfg: DictConfig) -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    missing = []
    for key in cfg:
        if key == "hydra":
            continue
        node = config_node(cfg, key)
        if OmegaConf.is_config(node):
            try:
                missing += sorted(OmegaConf.missing_keys(node))
            except InterpolationResolutionError:  # a node a command never reads (estimate's data)
                continue
        elif OmegaConf.is_missing(cfg, key):
            missing.append(str(key))
    if missing:
        raise ConfigErrors([invalid(key, "???", "a value is required: give it on the command line").args[0]
                            for key in sorted(missing)])  # fmt: skip


def _effective_batch(cfg: DictConfig, world_size: int) -> None:
    effective = cfg.get("effective_batch_size")
    accumulation = cfg.get("gradient_accumulation_steps")
    if not isinstance(effective, int) or not isinstance(accumulation, int) or accumulation < 1:
        return
    per_step = accumulation * world_size
    if effective % per_step:
        raise invalid(
            "effective_batch_size",
            effective,
            f"must be a multiple of gradient_accumulation_steps x processes = {per_step}, "
            "so that every micro-batch holds effective_batch_size / that many samples",
        )
    given = [
        o for o in command_line_overrides(cfg) if o.key_or_group == "micro_batch_size" and not o.is_delete()
    ]
    if given and not given[-1].is_sweep_override():
        micro = given[-1].value()
        if micro != effective // per_step:
            raise invalid(
                "micro_batch_size", micro,
                f"effective_batch_size={effective} with gradient_accumulation_steps x processes = {per_step} "
                f"sets it to {effective // per_step}: give one of the two",
            )  # fmt: skip


def _resume(cfg: DictConfig) -> None:
    resume = cfg.get("resume")
    if resume is not None and resume != "auto" and not os.path.exists(os.path.expanduser(str(resume))):
        raise invalid("resume", resume, "no such checkpoint folder: give null, auto or an existing path")


def _switches(cfg: DictConfig) -> None:
    """A switch given on the command line says true or false: OmegaConf reads 2, ``yes`` or ``on`` as
    true, and the job's folder name would keep ``=2``.

    Raises:
        ConfigError: the first switch given another word, naming it.
    """
    from effitrain.config.schema import switch_keys

    switches = switch_keys()
    for override in command_line_overrides(cfg):
        if override.key_or_group not in switches or override.is_delete() or override.is_sweep_override():
            continue  # a sweep's values are checked job by job, each as its own override
        given = override.value()
        if not isinstance(given, bool):
            raise invalid(override.key_or_group, given, "must be true or false")


def _precision(cfg: DictConfig, device: str | None) -> None:
    """The precision and a paged optimizer against the device: this machine's, or the one predicted for."""
    import torch

    precision = cfg.precision.mixed_precision
    cuda = cuda_available() if device is None else device == "cuda"
    if precision == "fp16" and not cuda:
        where = "(none found)" if device is None else "(--device cpu)"
        raise invalid("precision", "fp16", f"fp16 needs a CUDA device {where}: use precision=bf16 or fp32")
    if precision == "bf16" and device is None and cuda and not torch.cuda.is_bf16_supported():
        raise invalid("precision", "bf16", "this GPU lacks bf16: use precision=fp16 or fp32")
    target = str(cfg.optimizer.get("_target_", ""))
    if "Paged" in target and not cuda:
        raise invalid(
            *chosen(cfg, "optimizer"), "paged optimizers need a CUDA device: use adamw, adafactor or adam8bit"
        )


def _compile(cfg: DictConfig) -> None:
    # compile.mode is an enum of the schema: composition has checked it
    if cfg.compile.enabled:
        import torch

        if cfg.compile.backend not in torch.compiler.list_backends(exclude_tags=()):
            usual = torch.compiler.list_backends()  # without the debugging and experimental ones
            raise invalid("compile.backend", cfg.compile.backend, f"choose one of {', '.join(usual)}")
