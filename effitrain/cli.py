"""Command-line entry points: the Hydra task behind ``train.py`` and the ``effitrain`` console script."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
            validate(compose_known_keys(overrides), int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as error:
        fail(str(error))


def compose_known_keys(overrides: list[str]) -> DictConfig:
    """The composed config; ConfigError for ``key=value`` naming a key the config does not have."""
    import re

    from hydra.errors import ConfigCompositionException

    try:
        return compose_config(overrides)
    except ConfigCompositionException as error:
        match = re.search(r"Could not override '([^']+)'", str(error))
        if not match:
            raise
        key = match.group(1)
        parent_path = key.rpartition(".")[0]
        parent = compose_config([])
        for part in filter(None, parent_path.split(".")):
            parent = parent.get(part, {})
        known = ", ".join(sorted(k for k in parent if k != "hydra")) or "none"
        value = next(o.partition("=")[2] for o in overrides if o.startswith(f"{key}="))
        raise ConfigError(
            f"{key}={value!r} is not a config key: use +{key}=... to add one, or choose one of {known}"
        ) from None


def share_run_dir_across_ranks(argv: list[str]) -> list[str]:
    """Under ``torchrun``/``accelerate launch``, give every rank rank 0's Hydra run folder.

    Hydra names the folder from the clock, and ranks start a moment apart: without this, two
    processes of one job could write to two folders. Returns the overrides to pass on.
    """
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or any(a.startswith("hydra.run.dir=") for a in argv):
        return argv
    if "-m" in argv or "--multirun" in argv:
        return argv
    import time

    import torch.distributed as dist

    from effitrain.training import process_state

    process_state()  # joins the process group the launcher set up
    folder = [time.strftime("outputs/%Y-%m-%d/%H-%M-%S")]
    dist.broadcast_object_list(folder, src=0)
    return [*argv, f"hydra.run.dir={folder[0]}"]


def train_job(cfg: DictConfig) -> float | None:
    """The Hydra task: run one job into Hydra's output folder; exit non-zero if it failed.

    In a multirun a failed job returns instead, so the other jobs still run, and a job whose
    folder already holds an ok summary.json is skipped (``skip_ok_jobs``), so rerunning a sweep
    into its folder resumes it.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        from effitrain.sweep import start_job

        done = start_job(cfg, hydra_cfg)
        if done is not None:
            return done.get("eval/loss")

    from effitrain.run import run

    summary = run(cfg, hydra_cfg.runtime.output_dir)
    if summary["status"] == "ok" and summary.get("env/rank", 0) == 0:
        print(
            f"effitrain: ok: train/loss {summary['train/loss']:.4f}  eval/loss {summary['eval/loss']:.4f}  "
            f"eval/accuracy {summary['eval/accuracy']:.4f}  eval/f1 {summary['eval/f1']:.4f}  "
            f"{summary['speed/samples_per_s']:.1f} samples/s  {summary['speed/wall_s']:.1f} s  "
            f"-> {hydra_cfg.runtime.output_dir}"
        )
    if summary["status"] == "ok":
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


def _compare(args) -> None:
    from effitrain.compare import compare

    compare(args.folders, args.output, args.wandb_mode)


def _estimate(args) -> None:
    """Static memory of the run these overrides describe, for every option of the optimizer group."""
    import json

    from effitrain.config import group_options
    from effitrain.memory import MIB, estimate_memory

    # `optimizer=X` marks the chosen row; `optimizer.key=value` applies to that row only, since
    # the other optimizers may have no such key.
    base = [o for o in args.overrides if not o.startswith(("optimizer=", "optimizer."))]
    own = [o for o in args.overrides if o.startswith("optimizer.")]
    cfg = compose_config(args.overrides)
    chosen = cfg.hydra.runtime.choices.optimizer
    optimizers = {
        name: compose_config(base + [f"optimizer={name}"] + (own if name == chosen else [])).optimizer
        for name in group_options("optimizer")
    }
    rows = estimate_memory(cfg, optimizers)
    if args.json:
        print(json.dumps({"chosen": chosen, "optimizers": rows}, indent=2))
        return
    params = next(iter(rows.values()))["params"]
    print(f"effitrain estimate: {params:,} parameters; MiB (activations not included)")
    header = f"{'optimizer':<12}{'weights':>10}{'gradients':>11}{'opt. state':>12}{'total':>10}{'state B/param':>15}"
    print(header)
    for name, row in rows.items():
        cells = [
            row[k] / MIB if row[k] is not None else float("nan")
            for k in ("weights_bytes", "grads_bytes", "optimizer_state_bytes", "total_bytes")
        ]
        per_param = row["optimizer_bytes_per_param"] or float("nan")
        mark = "*" if name == chosen else " "
        print(
            f"{mark}{name:<11}"
            + "".join(f"{c:>{w}.1f}" for c, w in zip(cells, (10, 11, 12, 10)))
            + f"{per_param:>15.3f}"
        )
    print("* the chosen optimizer")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="effitrain", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="compose and validate a run config without running it")
    check.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    check.set_defaults(handler=_check)
    comparison = commands.add_parser(
        "compare", help="table, plots and one HTML page comparing the jobs of one or more sweep folders"
    )
    comparison.add_argument("folders", nargs="+", type=Path, help="sweep folders (multirun/...)")
    comparison.add_argument(
        "--output", type=Path, help="where to write the report (default: the first folder)"
    )
    comparison.add_argument(
        "--wandb-mode",
        choices=["online", "offline", "disabled"],
        help="how to log the table to W&B for sweeps that logged to W&B (default: offline without credentials)",
    )
    comparison.set_defaults(handler=_compare)
    estimate = commands.add_parser(
        "estimate",
        help="weights, gradients and optimizer state of a run, for every optimizer, without weights",
    )
    estimate.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    estimate.add_argument("--json", action="store_true", help="exact bytes as JSON, for scripts")
    estimate.set_defaults(handler=_estimate)
    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except ConfigError as error:
        fail(str(error))


if __name__ == "__main__":
    main()
