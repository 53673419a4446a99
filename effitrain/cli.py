"""Command-line entry points: the Hydra task behind ``train.py`` and the ``effitrain`` console script."""

from __future__ import annotations

import argparse
import sys

from omegaconf import DictConfig

from effitrain.config import ConfigError, check_group_overrides, check_output_overrides


def fail(message: str, code: int = 2):
    print(f"effitrain: error: {message}", file=sys.stderr)
    sys.exit(code)


def check_overrides_or_exit(overrides: list[str]) -> None:
    """Reject bad overrides before Hydra starts, so a mistake leaves the run folder as it was
    (Hydra rewrites ``.hydra/`` there before the task runs). A single run is composed and
    validated here; a multirun validates each job when it starts."""
    import os

    from effitrain.config import validate

    try:
        check_group_overrides(overrides)
        check_output_overrides(overrides)
        if not any(arg.startswith("-") for arg in overrides):  # -m, --cfg, --help...: leave to Hydra
            validate(compose_config(overrides), int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as error:
        fail(str(error))


def train_job(cfg: DictConfig) -> float | None:
    """The Hydra task: run one job into Hydra's output folder; exit non-zero if it failed.

    In a multirun a failed job returns instead, so the other jobs still run.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from effitrain.run import run

    hydra_cfg = HydraConfig.get()
    summary = run(cfg, hydra_cfg.runtime.output_dir)
    if summary["status"] == "ok":
        print(
            f"effitrain: ok: train/loss {summary['train/loss']:.4f}  eval/loss {summary['eval/loss']:.4f}  "
            f"eval/accuracy {summary['eval/accuracy']:.4f}  eval/f1 {summary['eval/f1']:.4f}  "
            f"{summary['speed/samples_per_s']:.1f} samples/s  {summary['speed/wall_s']:.1f} s  "
            f"-> {hydra_cfg.runtime.output_dir}"
        )
        return summary["eval/loss"]
    message = f"{summary['status']}: {summary['error']}"
    if hydra_cfg.mode == RunMode.MULTIRUN:
        print(f"effitrain: job {hydra_cfg.job.num} {message}", file=sys.stderr)
        return None
    fail(message, 2 if summary.get("error_type") == "config" else 1)


def compose_config(overrides: list[str]) -> DictConfig:
    """The run config ``train.py`` would compose for these overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from effitrain.config import CONF_DIR

    check_group_overrides(overrides)
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="effitrain"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
    return cfg


def _check(args) -> None:
    from effitrain.config import validate

    cfg = compose_config(args.overrides)
    validate(cfg)
    print("effitrain: the configuration is valid")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="effitrain", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="compose and validate a run config without running it")
    check.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    check.set_defaults(handler=_check)
    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except ConfigError as error:
        fail(str(error))
