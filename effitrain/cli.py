"""Command-line entry points: the Hydra task behind ``train.py`` and the ``effitrain`` console script."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from effitrain.config import (
    ConfigError,
    check_group_overrides,
    check_output_folder,
    check_output_overrides,
    compose,
    compose_known,
)


def fail(message: str, code: int = 2):
    for line in str(message).splitlines() or [""]:
        print(f"effitrain: error: {line}", file=sys.stderr)
    sys.exit(code)


# Hydra's command-line flags that are not overrides; any other flag (--cfg, --info, --help...) is
# left to Hydra with the overrides unchecked.
_MULTIRUN_FLAGS = ("-m", "--multirun")
MAX_JOBS_CHECKED = 64  # a sweep's first jobs validated before any starts; the rest when they start


def check_overrides_or_exit(argv: list[str]) -> None:
    """Reject bad overrides before Hydra starts, so a mistake leaves the run folder as it was
    (Hydra rewrites ``.hydra/`` there before the task runs): a single run is composed and
    validated here, and so is every job of a sweep (up to ``MAX_JOBS_CHECKED``)."""
    try:
        cfg = preflight(argv, int(os.environ.get("WORLD_SIZE", "1")))
        if cfg is not None:
            from effitrain.results import finished_run

            finished = finished_run(cfg, Path(cfg.hydra.run.dir))
            if finished is not None:
                print(finished)
                sys.exit(0)
    except ConfigError as error:
        fail(str(error))


def preflight(argv: list[str], world_size: int = 1) -> DictConfig | None:
    """Everything a run or sweep would reject, checked from the command line alone; returns a
    single run's composed config (None for a sweep, or flags left to Hydra).

    Raises:
        ConfigError: the first grammar problem, or every problem of the first bad job.
    """
    from effitrain.config import checked, compose_checked, load
    from effitrain.overrides import parse

    flags = [a for a in argv if a.startswith("-")]
    if any(flag not in _MULTIRUN_FLAGS for flag in flags):
        return None
    overrides = [a for a in argv if not a.startswith("-")]
    parsed = parse(overrides)
    check_group_overrides(overrides)
    check_output_overrides(overrides)
    sweeps = [o for o in parsed if o.is_sweep_override()]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    cfg, problems = compose_checked(fixed)
    multirun = bool(flags) or str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    if sweeps and not multirun:
        raise ConfigError(
            f"{sweeps[0].input_line} is a sweep (several values): add -m to run one job per value, "
            "or give one value"
        )
    if not multirun:
        cfg = checked(cfg, problems, world_size)
        check_output_folder("hydra.run.dir", str(cfg.hydra.run.dir))
        return cfg
    check_output_folder("hydra.sweep.dir", str(cfg.hydra.sweep.dir))
    if str(cfg.hydra.launcher.get("_target_", "")).endswith(".EffitrainLauncher"):
        from effitrain.sweep import launcher_settings

        launcher_settings(cfg.hydra.launcher)
    for job in sweep_jobs(fixed, sweeps, cfg)[:MAX_JOBS_CHECKED]:
        try:
            load(fixed + job, world_size)
        except ConfigError as error:
            label = " ".join(job) or "the defaults"
            raise ConfigError(f"the sweep's job {label}:\n{error}") from None
    return None


def sweep_jobs(fixed: list[str], sweeps, cfg) -> list[list[str]]:
    """The override lists of a sweep's jobs: the command line's sweeps with the study's
    ``hydra.sweeper.params`` (the command line wins for a key both name), as Hydra's sweeper expands them."""
    import itertools

    from effitrain.overrides import parse, values, with_value

    params = {
        o.key_or_group: o
        for o in parse(f"{k}={v}" for k, v in (cfg.hydra.sweeper.get("params") or {}).items())
    }
    fixed_keys = {o.key_or_group for o in parse(fixed)}
    params = {k: o for k, o in params.items() if k not in fixed_keys}
    params.update({o.key_or_group: o for o in sweeps})
    axes = []
    for override in params.values():
        choices = values(override)
        if choices is None:  # a glob: Hydra expands it, each job validates itself when it starts
            continue
        axes.append([with_value(override, choice) for choice in choices])
    return [list(job) for job in itertools.product(*axes)]


def share_run_dir_across_ranks(argv: list[str]) -> list[str]:
    """Under ``torchrun``/``accelerate launch``, give every rank rank 0's Hydra run folder.

    Hydra names the folder from the clock, and ranks start a moment apart: without this, two
    processes of one job could write to two folders. Returns the overrides to pass on.
    """
    import os

    from effitrain.overrides import parse

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "-m" in argv or "--multirun" in argv:
        return argv
    if any(o.key_or_group == "hydra.run.dir" for o in parse(a for a in argv if not a.startswith("-"))):
        return argv
    import time

    import torch.distributed as dist

    from effitrain.distributed import process_state

    process_state()  # joins the process group the launcher set up
    folder = [time.strftime("outputs/%Y-%m-%d/%H-%M-%S")]
    dist.broadcast_object_list(folder, src=0)
    return [*argv, f"hydra.run.dir={folder[0]}"]


def train(argv: list[str]) -> None:
    """``python train.py ARGS`` and ``effitrain train ARGS``: check, then hand over to Hydra."""
    import hydra

    from effitrain.config import CONF_SOURCE

    check_overrides_or_exit(argv)
    argv = share_run_dir_across_ranks(argv)
    from effitrain.sweep import expose_launcher_plugin

    expose_launcher_plugin()
    # Hydra reads the command line from sys.argv; the config comes from the package effitrain.conf,
    # the checkout's conf/ or the copy inside an installed wheel
    sys.argv = [sys.argv[0], *argv]
    hydra.main(version_base="1.3", config_path=CONF_SOURCE, config_name="config")(train_job)()


def train_job(cfg: DictConfig) -> float | None:
    """The Hydra task: run one job into Hydra's output folder; exit non-zero if it failed.

    In a multirun a failed job returns instead, so the other jobs still run, and a job whose
    folder already holds an ok summary.json is skipped (``skip_ok_jobs``), so rerunning a sweep
    into its folder resumes it.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from effitrain.config import task_config

    hydra_cfg = HydraConfig.get()  # the task is the one place that reads it: the run reads cfg.hydra
    cfg = task_config(cfg, hydra_cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if hydra_cfg.mode == RunMode.MULTIRUN:
        from effitrain.sweep import start_job

        done = start_job(cfg, hydra_cfg)
        if done is not None:
            return done.get(cfg.get("optimized_metric", "eval/loss"))

    from effitrain.run import run

    summary = run(cfg, hydra_cfg.runtime.output_dir)
    if summary["status"] == "ok" and summary.get("env/rank", 0) == 0:
        task_keys = ("eval/accuracy", "eval/f1", "eval/perplexity", "train/unigram_perplexity")
        task_metrics = "".join(f"{k} {summary[k]:.4f}  " for k in task_keys if k in summary)
        print(
            f"effitrain: ok: train/loss {summary['train/loss']:.4f}  eval/loss {summary['eval/loss']:.4f}  "
            f"{task_metrics}{summary['speed/samples_per_s']:.1f} samples/s  {summary['speed/wall_s']:.1f} s  "
            f"-> {hydra_cfg.runtime.output_dir}"
        )
    if summary["status"] == "ok":
        return summary.get(cfg.get("optimized_metric", "eval/loss"))
    message = f"{summary['status']}: {summary['error']}"
    if summary["status"] == "interrupted":  # the shell's convention: 128 + the signal's number
        print(f"effitrain: error: {message}; resume with resume=auto", file=sys.stderr)
        sys.exit(128 + summary["signal"])
    if hydra_cfg.mode == RunMode.MULTIRUN:
        print(f"effitrain: job {hydra_cfg.job.num} {message}", file=sys.stderr)
        return None
    fail(message, 2 if summary.get("error_type") == "config" else 1)


# the composition lives in effitrain.config (the config's front door); these names stay for callers
compose_config = compose
compose_known_keys = compose_known


def _check(args) -> None:
    preflight(args.overrides)
    print("effitrain: the configuration is valid")


def _compare(args) -> None:
    from effitrain.compare import compare

    try:
        compare(args.folders, args.output, args.wandb_mode)
    except OSError as error:  # a report file that cannot be written: one line, not a traceback
        where = args.output or args.folders[0]
        raise ConfigError(
            f"--output={str(where)!r} is invalid: cannot be written ({error.strerror})"
        ) from None


def _estimate(args) -> None:
    """Static memory of the run these overrides describe, for every option of the optimizer group."""
    import json

    from effitrain.config import group_options
    from effitrain.memory import MIB, estimate_memory

    # `optimizer=X` marks the chosen row; `optimizer.key=value` applies to that row only, since
    # the other optimizers may have no such key.
    from effitrain.overrides import names, parse

    parsed = parse(args.overrides)
    base = [o.input_line for o in parsed if not names(o, "optimizer")]
    own = [o.input_line for o in parsed if names(o, "optimizer") and o.key_or_group != "optimizer"]
    cfg = compose_known(args.overrides)  # unknown keys named with the nearest real ones
    chosen = cfg.hydra.runtime.choices.optimizer
    optimizers = {
        name: compose_config(base + [f"optimizer={name}"] + (own if name == chosen else [])).optimizer
        for name in group_options("optimizer")
    }
    if cfg.get("gradient_checkpointing"):
        raise ConfigError(
            "gradient_checkpointing=true is invalid for estimate: its step peak is not predicted yet "
            "(the run measures it); estimate without it for an upper bound"
        )
    rows = estimate_memory(cfg, optimizers)
    if args.json:
        print(json.dumps({"chosen": chosen, "optimizers": rows}, indent=2))
        return
    first = next(iter(rows.values()))
    print(
        f"effitrain estimate: {first['params']:,} parameters (vocabulary {first['vocab_size']:,}); one step of "
        f"{cfg.gradient_accumulation_steps} x {cfg.micro_batch_size} samples x {cfg.max_length} tokens "
        f"(the worst case), precision={cfg.hydra.runtime.choices.precision}, "
        f"gradient_checkpointing={str(bool(cfg.gradient_checkpointing)).lower()}; MiB at the step peak"
    )
    columns = ["weights", "gradients", "optimizer_state", "activations", "temporaries"]
    titles = [
        "weights",
        "gradients",
        "opt. state",
        "activations",
        "temporaries",
        "step peak",
        "state B/param",
    ]
    print(f"{'optimizer':<12}" + "".join(f"{t:>{max(len(t) + 2, 10)}}" for t in titles))
    for name, row in rows.items():
        cells = [row["step_peak"][f"{c}_bytes"] / MIB for c in columns] + [row["step_peak_bytes"] / MIB]
        widths = [max(len(t) + 2, 10) for t in titles]
        per_param = row["optimizer_bytes_per_param"] or float("nan")
        mark = "*" if name == chosen else " "
        print(f"{mark}{name:<11}" + "".join(f"{c:>{w}.1f}" for c, w in zip(cells + [per_param], widths)))
    print("* the chosen optimizer; opt. state at the peak includes the step's own optimizer temporaries")


def _plan(args) -> None:
    import json

    from effitrain.memory import MIB
    from effitrain.plan import parse_bytes, plan, probe

    budget = parse_bytes(args.memory_budget)
    if args.effective_batch_size is not None and args.effective_batch_size < 1:
        raise ConfigError(f"--effective-batch-size={args.effective_batch_size} is invalid: must be >= 1")
    optimizers = args.optimizers.split(",") if args.optimizers else None
    rows = plan(args.overrides, budget, args.effective_batch_size, optimizers)
    if not any(row["fits"] for row in rows):
        smallest = min(rows, key=lambda r: r["step_peak_bytes_predicted"])
        raise ConfigError(
            f"--memory-budget={args.memory_budget!r}: nothing fits; the smallest predicted step peak is "
            f"{smallest['step_peak_bytes_predicted'] / MIB:.1f} MiB ({smallest['command']})"
        )
    if args.probe_steps:
        rows = probe(rows, args.overrides, args.probe_steps)
    if args.json:
        print(json.dumps({"memory_budget_bytes": budget, "candidates": rows}, indent=2))
        return
    print(f"effitrain plan: budget {budget / MIB:.0f} MiB; best first (step peak predicted at max_length)")
    print(
        f"{'fits':<5}{'optimizer':<11}{'precision':<10}{'micro':>6}{'accum':>6}{'peak MiB':>10}{'step s':>8}"
    )
    for row in rows:
        step_s = f"{row['step_s_measured']:.3f}" if row.get("step_s_measured") else ""
        print(
            f"{'yes' if row['fits'] else 'no':<5}{row['optimizer']:<11}{row['precision']:<10}"
            f"{row['micro_batch_size']:>6}{row['gradient_accumulation_steps']:>6}"
            f"{row['step_peak_bytes_predicted'] / MIB:>10.1f}{step_s:>8}"
        )
    print(f"effitrain plan: best: {rows[0]['command']}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # everything after it is Hydra's: overrides, -m, --cfg job, ...
        train(argv[1:])
        return
    from effitrain import __version__

    parser = argparse.ArgumentParser(prog="effitrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"effitrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("train", help="train one configuration, or sweep with -m (as python train.py)")
    check = commands.add_parser("check", help="compose and validate a run config without running it")
    check.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="Hydra overrides, as for train.py (-m: every job of a sweep)",
    )
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
    planning = commands.add_parser(
        "plan", help="the fastest optimizer x micro batch x precision whose predicted step peak fits a budget"
    )
    planning.add_argument("--memory-budget", required=True, help="e.g. 8GiB, 500MiB, 24GB")
    planning.add_argument(
        "--effective-batch-size", type=int, help="samples per optimizer step (default: the config's)"
    )
    planning.add_argument("--optimizers", help="comma-separated options of conf/optimizer (default: all)")
    planning.add_argument(
        "--probe-steps", type=int, default=0, help="run K real steps of the top 3, rank by time"
    )
    planning.add_argument("--json", action="store_true", help="every candidate as JSON, for scripts")
    planning.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    planning.set_defaults(handler=_plan)
    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except ConfigError as error:
        fail(str(error))


if __name__ == "__main__":
    main()
