"""A job's identity: the keys that make ``summary.json`` self-describing (its config choices, its
result-changing overrides, a short name, its folders) and where its W&B run goes.

Compare and W&B read these keys, never Hydra's files. Computed from a composed config; the
loggers and the sweep's report write them.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from effitrain.config.errors import ConfigError
from effitrain.config.techniques import TECHNIQUES


def summary_config_keys(cfg: DictConfig, output_dir: Path, world: int) -> dict:
    """The keys that make ``summary.json`` self-describing: ``cfg/<group>`` for every config group's
    choice, the run-shaping scalars, the job's identity (its result-changing overrides, a short
    name, its sweep folder) and where its W&B run goes. Compare and W&B read these, never Hydra's
    files. The job's Hydra record is ``cfg.hydra`` (see :func:`effitrain.config.compose.with_hydra_node`); without one (a
    config built by hand) there are no choices or overrides."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from effitrain.config.overrides import job_overrides, short_name

    hydra = cfg.get("hydra")
    choices = {k: v for k, v in (hydra.runtime.choices if hydra else {}).items() if not k.startswith("hydra")}
    invariant = set(cfg.get("run_invariant_keys") or [])
    # as typed: resolving ${oc.env:...} here would copy secrets into the summary
    task_overrides = OmegaConf.to_container(hydra.overrides.task, resolve=False) if hydra else []
    multirun = hydra is not None and hydra.mode == RunMode.MULTIRUN
    sweep_dir = str(Path(hydra.sweep.dir).absolute()) if multirun else None
    accumulation, micro = cfg.gradient_accumulation_steps, cfg.micro_batch_size
    effective = (
        micro * accumulation * world if isinstance(micro, int) and isinstance(accumulation, int) else None
    )
    keys = {f"cfg/{group}": option for group, option in choices.items()}
    keys.update(
        {
            "cfg/seed": cfg.seed,
            "cfg/gradient_accumulation_steps": accumulation,
            "cfg/micro_batch_size": micro,
            "cfg/effective_batch_size": effective,
            "cfg/world_size": world,
            "cfg/lr": cfg.optimizer.get("lr"),
            "cfg/model_name_or_path": cfg.model.name_or_path,
            # each memory lever's setting (effitrain.config.techniques): what the step peak was made with
            **{f"cfg/{technique.key}": cfg.get(technique.key) for technique in TECHNIQUES},
            "job/overrides": job_overrides(task_overrides, invariant),
            "job/name": short_name(task_overrides, invariant, set(choices)),
            "job/sweep_dir": sweep_dir,
            "job/dir": str(Path(output_dir).absolute()),
        }
    )
    keys.update(wandb_keys(cfg.get("logger"), keys, output_dir))
    return keys


def wandb_keys(logger: DictConfig | None, keys: dict, output_dir: Path) -> dict:
    """Where the job's W&B run goes (:func:`effitrain.train.loggers.wandb_destination`, from the
    logger config and the job's ``keys``; the W&B logger replaces them with what ``wandb.init`` gave
    once it started, ``wandb/run_id`` included); mode ``disabled`` without W&B."""
    from effitrain.train.loggers import job_identity, resolve_mode, wandb_destination

    target = str((logger or {}).get("_target_") or "")
    if not target.endswith("WandbLogger"):
        return {"wandb/project": None, "wandb/entity": None, "wandb/group": None, "wandb/mode": "disabled",
                "wandb/run_id": None}  # fmt: skip
    try:
        mode = resolve_mode(logger.get("mode"))
    except ConfigError:  # the run reports it when it starts the logger
        mode = None
    settings = {key: logger.get(key) for key in ("project", "entity", "group")}
    where = wandb_destination(job_identity(output_dir, keys), **settings)
    return {
        "wandb/project": where["project"],
        "wandb/entity": where["entity"],
        "wandb/group": where["group"],
        "wandb/mode": mode,
        "wandb/run_id": None,
    }
