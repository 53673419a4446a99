"""effitrain: memory- and speed-efficient fine-tuning of Hugging Face transformers.

  effitrain train optimizer=adam8bit         one run (the same as python train.py)
  effitrain check -m optimizer=adamw,lion    validate a run or a sweep, run nothing
  effitrain compare multirun/<study>/<time>  verdict, table, plots, one HTML page
  effitrain estimate model=tiny              a run's memory by category, beforehand
  effitrain plan --memory-budget 8GiB        the fastest combination that fits

'effitrain <command> --help' tells more about one command.
"""
# This docstring is the --help text, so it is plain text; the Hydra side is effitrain/commands/front_door.py.

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from effitrain.commands.front_door import MULTIRUN_FLAGS, preflight, train
from effitrain.commands.plan import DEFAULT_MARGIN
from effitrain.config import techniques
from effitrain.config.compose import compose
from effitrain.config.errors import ConfigError, fail
from effitrain.config.schema import DEVICES


def default_device() -> str:
    """Where a run with these settings would train: CUDA when it is available."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check(args) -> None:
    for flag in (a for a in args.overrides if a.startswith("-") and a not in MULTIRUN_FLAGS):
        # preflight leaves other flags (--cfg, --info, ...) to Hydra and checks nothing then
        raise ConfigError(f"{flag} is invalid: effitrain check takes overrides and -m/--multirun only")
    checked: list[int] = []
    preflight(args.overrides, jobs_checked=checked)
    if checked:  # a sweep
        print(f"effitrain: the configuration is valid: {checked[0]} jobs checked")
    else:
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

    from effitrain.commands.estimate import estimate_memory
    from effitrain.config.load import load

    # `optimizer=X` marks the chosen row; `optimizer.key=value` applies to that row only, since
    # the other optimizers may have no such key.
    from effitrain.config.overrides import names, parse
    from effitrain.config.registry import group_options, installed_optimizers
    from effitrain.memory import MIB

    parsed = parse(args.overrides)
    base = [o.input_line for o in parsed if not names(o, "optimizer")]
    own = [o.input_line for o in parsed if names(o, "optimizer") and o.key_or_group != "optimizer"]
    device = args.device or default_device()
    if args.optimizers:
        _check_optimizer_options(args.optimizers.split(","))
    # validated as check does, for the device predicted for; the data and weights are never read
    cfg = load(args.overrides, device=device, loads=False)
    world_size = sharded_world_size(cfg, args.world_size)
    chosen = cfg.hydra.runtime.choices.optimizer
    optimizers = {
        name: compose(base + [f"optimizer={name}"] + (own if name == chosen else [])).optimizer
        for name in (
            args.optimizers.split(",")
            if args.optimizers
            else installed_optimizers(group_options("optimizer"))
        )
    }
    started = time.perf_counter()
    rows = estimate_memory(cfg, optimizers, device=device, cache=not args.no_cache, share=not args.no_share,
                           world_size=world_size or 1)  # fmt: skip
    took_s = time.perf_counter() - started
    if args.json:
        result = {"chosen": chosen, "device": device, "world_size": world_size, "estimate_s": took_s}
        print(json.dumps({**result, "optimizers": rows}, indent=2))
        return
    refused = {name: row["unsupported"] for name, row in rows.items() if "unsupported" in row}
    rows = {name: row for name, row in rows.items() if name not in refused}
    if not rows:
        raise ConfigError(next(iter(refused.values())))
    first = next(iter(rows.values()))
    trained = (  # said where an adapter leaves weights frozen
        f", {first['params_trainable']:,} trained with adapter={cfg.hydra.runtime.choices.adapter}"
        if first["params_trainable"] != first["params"]
        else ""
    )
    print(
        f"effitrain estimate: {first['params']:,} parameters{trained} (vocabulary {first['vocab_size']:,}); one step of "
        f"{cfg.gradient_accumulation_steps} x {cfg.micro_batch_size} samples x {cfg.max_length} tokens "
        f"(the worst case), precision={cfg.hydra.runtime.choices.precision}, "
        f"{techniques.described(cfg)}; as {device.upper()} holds it "
        "(--device); MiB at the step peak"
        + (f"; one rank of {world_size} (parallel=fsdp, --world-size)" if world_size else "")
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
    for name, row in rows.items():
        if row["step_peak_bound"]:
            print(f"{name}: an upper bound of its step peak: {row['step_peak_bound']}")
    print(
        f"\nthe run's peak by phase, MiB (evaluation at eval_batch_size={cfg.eval_batch_size} x {cfg.max_length} tokens)"
    )
    phases = list(first["run_peak"])
    print(
        f"{'optimizer':<12}"
        + "".join(f"{p.removesuffix('_bytes'):>14}" for p in phases)
        + f"{'run peak':>14}"
    )
    for name, row in rows.items():
        mark = "*" if name == chosen else " "
        cells = [row["run_peak"][p] / MIB for p in phases] + [row["run_peak_bytes"] / MIB]
        print(f"{mark}{name:<11}" + "".join(f"{c:>14.1f}" for c in cells))
    for name, row in rows.items():
        if row["run_peak_bound"]:
            print(f"{name}: an upper bound of its run peak: {row['run_peak_bound']}")
    if cfg.get("adapter") is not None and cfg.adapter.get("quantization") is not None:
        # said, not left silent: the tracker counts tensors, and this state is neither a parameter nor a buffer
        print(
            "weights: the 4-bit layers by their packed codes; their quantization state (absmax, the nested "
            "state and map, about 1/64 B per weight more) is outside these figures, counted in a run's "
            "mem/params_bytes"
        )
    for name, error in refused.items():
        print(f"{name}: not predicted: {error}")
    sources = sorted({row["trace_source"] for row in rows.values()})
    print(f"\nthe estimate took {took_s:.1f} s (traces: {', '.join(sources)}; --no-cache, --no-share)")


def sharded_world_size(cfg, world_size: int | None) -> int | None:
    """The processes an FSDP estimate shards over (``--world-size``, 1 when not given); None for an
    unsharded run, where every rank holds what one process holds.

    Raises:
        ConfigError: ``--world-size`` below 1, or given without ``parallel=fsdp``.
    """
    sharded = cfg.parallel.strategy == "fsdp"
    if world_size is not None and not sharded:
        raise ConfigError(
            f"--world-size={world_size} is invalid with parallel={cfg.parallel.strategy}: only parallel=fsdp "
            "shards (every data-parallel rank holds what one process holds)"
        )
    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size={world_size} is invalid: expected a number of processes, 1 or more")
    return (world_size or 1) if sharded else None


def _check_adapter_options(names: list[str]) -> None:
    """``--adapters``: each an option of conf/adapter (one line if not)."""
    from effitrain.config.registry import group_options

    options = group_options("adapter")
    for name in names:
        if name not in options:
            raise ConfigError(f"--adapters={name!r} is invalid: choose from {', '.join(options)}")


def _check_optimizer_options(names: list[str]) -> None:
    """``--optimizers``: each an option of conf/optimizer whose package is installed (one line if not)."""
    from omegaconf import OmegaConf

    from effitrain.config.registry import CONF_DIR, group_options, install_hint, missing_module

    options = group_options("optimizer")
    for name in names:
        if name not in options:
            raise ConfigError(f"--optimizers={name!r} is invalid: choose from {', '.join(options)}")
        missing = missing_module(OmegaConf.load(CONF_DIR / "optimizer" / f"{name}.yaml"))
        if missing is not None:
            raise ConfigError(
                f"--optimizers={name!r} is invalid: {missing} is not installed ({install_hint(missing)})"
            )


def _plan(args) -> None:
    import json

    from effitrain.commands.plan import parse_bytes, plan, plan_over_gpus, probe, weights_fit
    from effitrain.config.load import load
    from effitrain.memory import MIB

    budget = parse_bytes(args.memory_budget)
    if args.effective_batch_size is not None and args.effective_batch_size < 1:
        raise ConfigError(f"--effective-batch-size={args.effective_batch_size} is invalid: must be >= 1")
    if args.probe_steps and args.probe_steps < 4:
        raise ConfigError(
            f"--probe-steps={args.probe_steps} is invalid: give 0 (no probe) or at least 4 (the first two "
            "steps and the memory-tracked one are not timed)"
        )
    if not 0 <= args.margin < 1:
        raise ConfigError(
            f"--margin={args.margin} is invalid: give the share of the budget kept free, in [0, 1)"
        )
    optimizers = args.optimizers.split(",") if args.optimizers else None
    if optimizers:
        _check_optimizer_options(optimizers)
    adapters = args.adapters.split(",") if args.adapters else None
    if adapters:
        _check_adapter_options(adapters)
    device = args.device or default_device()
    # validated as check does, for the device planned for; the data and weights are never read
    try:
        gpus = [int(count) for count in args.gpus.split(",")]
    except ValueError:
        raise ConfigError(f"--gpus={args.gpus!r} is invalid: give numbers of GPUs, e.g. 1,8,64") from None
    sharded = gpus != [1]  # a GPUs column only where there is a choice of them
    if adapters and sharded:
        raise ConfigError(
            f"--adapters={args.adapters!r} is invalid with --gpus={args.gpus}: adapters are planned on one "
            "device (an adapter under parallel=fsdp is not built)"
        )
    traces = {"cache": not args.no_cache, "share": not args.no_share}
    if adapters:
        # an adapter whose weights alone are over budget is left out (a 4-bit base may fit where
        # the full one does not); none fitting is said as one of them
        fitting, refused = [], None
        for adapter in adapters:
            try:
                chosen = load([*args.overrides, f"adapter={adapter}"], device=device, loads=False)
                weights_fit(chosen, budget, args.memory_budget, args.margin)
                fitting.append(adapter)
            except ConfigError as error:
                refused = error
        if not fitting:
            raise refused
        rows = plan(args.overrides, budget, args.effective_batch_size, optimizers, device=device,
                    margin=args.margin, adapters=fitting, **traces)  # fmt: skip
    else:
        load(args.overrides, device=device, loads=False)
        rows = plan_over_gpus(
            args.overrides, budget, args.memory_budget, gpus, args.effective_batch_size, optimizers, device,
            args.margin, **traces,
        )  # fmt: skip
    if not any(row["fits"] for row in rows):
        smallest = min(rows, key=lambda r: r["run_peak_bytes_predicted"])
        raise ConfigError(
            f"--memory-budget={args.memory_budget!r}: nothing fits; the smallest predicted run peak is "
            f"{smallest['run_peak_bytes_predicted'] / MIB:.1f} MiB with a {args.margin:.0%} margin to add "
            f"({smallest['command']})"
        )
    if args.probe_steps:
        rows = probe(rows, args.overrides, args.probe_steps)
    if args.json:
        print(json.dumps({"memory_budget_bytes": budget, "candidates": rows}, indent=2))
        return
    print(
        f"effitrain plan: budget {budget / MIB:.0f} MiB on {device.upper()}; a candidate fits when its run's peak "
        f"(the largest phase, predicted at max_length) plus a {args.margin:.0%} margin for the allocator's "
        "fragmentation (--margin)"
        + (" and cuBLAS's two workspaces (64 MiB)" if device == "cuda" else "")
        + " is within it; best first"
    )
    if adapters:
        print(
            f"adapters ranked in the order given ({args.adapters}): an adapter is picked for memory, not quality"
        )
    print(
        (f"{'adapter':<9}" if adapters else "")
        + f"{'fits':<5}"
        + (f"{'gpus':<5}" if sharded else "")
        + f"{'optimizer':<13}{'precision':<10}{'micro':>6}{'accum':>6}{'recompute':>10}{'step MiB':>10}"
        f"{'run MiB':>10}" + (f"{'step s':>8}" if args.probe_steps else "")
    )
    # over budget, only each adapter, optimizer and precision's smallest peak: the JSON has every candidate
    smallest = {}
    for row in rows:
        key = (row.get("adapter"), row["optimizer"], row["precision"], row["gpus"])
        if key not in smallest or row["run_peak_bytes_predicted"] < smallest[key]["run_peak_bytes_predicted"]:
            smallest[key] = row
    shown = [
        r for r in rows
        if r["fits"] or r is smallest[(r.get("adapter"), r["optimizer"], r["precision"], r["gpus"])]
    ]  # fmt: skip
    for row in shown:
        step_s = f"{row['step_s_measured']:.3f}" if row.get("step_s_measured") else ""
        print(
            (f"{row['adapter']:<9}" if adapters else "")
            + f"{'yes' if row['fits'] else 'no':<5}"
            + (f"{row['gpus']:<5}" if sharded else "")
            + f"{row['optimizer']:<13}{row['precision']:<10}"
            f"{row['micro_batch_size']:>6}{row['gradient_accumulation_steps']:>6}"
            f"{'yes' if row['gradient_checkpointing'] else 'no':>10}"
            f"{row['step_peak_bytes_predicted'] / MIB:>10.1f}{row['run_peak_bytes_predicted'] / MIB:>10.1f}"
            + (f"{step_s:>8}" if args.probe_steps else "")
        )
    if len(shown) < len(rows):
        print(f"({len(rows) - len(shown)} more over budget; --json lists them)")
    print(f"effitrain plan: best: {rows[0]['command']}")


def _trace_flags(parser) -> None:
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="trace again rather than read (and write) the traces kept in $EFFITRAIN_CACHE_DIR/traces",
    )
    parser.add_argument(
        "--no-share",
        action="store_true",
        help="a full replay per optimizer, nothing shared and every micro-batch replayed (as before: slower, same bytes)",
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # everything after it is Hydra's: overrides, -m, --cfg job, ...
        train(argv[1:])
        return
    if argv[:1] == ["check"] and not {"-h", "--help"} & set(argv):  # -m may come first: not argparse's
        try:
            _check(argparse.Namespace(overrides=argv[1:]))
        except ConfigError as error:
            fail(str(error))
        return
    from effitrain import __version__

    parser = argparse.ArgumentParser(
        prog="effitrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"effitrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("train", help="train one configuration, or sweep with -m (as python train.py)")
    check = commands.add_parser(
        "check",
        help="validate a run's configuration (or every job of a sweep, with -m) without running it",
        description="Compose and validate the configuration train.py would run, and run nothing: every "
        "problem is one line naming the key, its value and what is allowed (exit code 2).",
    )
    check.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="Hydra overrides, as for train.py (-m: every job of a sweep)",
    )
    check.set_defaults(handler=_check)
    comparison = commands.add_parser(
        "compare",
        help="table, plots and one HTML page comparing the jobs of one or more sweep folders",
        description="Compare the jobs of one or more sweep folders: a verdict, a table (comparison.md, "
        "comparison.csv), plots and one self-contained comparison.html, written into the first folder.",
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
        help="predict a run's memory by category, for every optimizer, before running it",
        description="Predict the memory of the run these overrides describe, for every optimizer of "
        "conf/optimizer: weights, gradients, optimizer state, activations and temporaries at the step "
        "peak, and the run's peak by phase. The model is built from its config on the meta device and "
        "one step is replayed on fake tensors at the worst case (every sample max_length tokens): no "
        "weights or data are loaded and nothing is allocated.",
    )
    estimate.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    estimate.add_argument("--json", action="store_true", help="exact bytes as JSON, for scripts")
    estimate.add_argument(
        "--device",
        choices=DEVICES,
        help="predict what this device holds, with its kernels (default: cuda where available, else cpu)",
    )
    estimate.add_argument(
        "--optimizers", help="comma-separated options of conf/optimizer to estimate (default: all)"
    )
    estimate.add_argument(
        "--world-size",
        type=int,
        help="with parallel=fsdp: predict one rank of this many processes (default 1)",
    )
    _trace_flags(estimate)
    estimate.set_defaults(handler=_estimate)
    planning = commands.add_parser(
        "plan",
        help="the fastest optimizer x micro batch x precision whose predicted peak fits a memory budget",
        description="Find the fastest combination of optimizer, precision, micro batch (accumulation "
        "follows) and gradient checkpointing whose predicted run peak, plus a margin for the allocator, "
        "fits a memory budget; ranked by rules of thumb, or by measured step time with --probe-steps.",
    )
    planning.add_argument("--memory-budget", required=True, help="e.g. 8GiB, 500MiB, 24GB")
    planning.add_argument(
        "--effective-batch-size", type=int, help="samples per optimizer step (default: the config's)"
    )
    planning.add_argument("--optimizers", help="comma-separated options of conf/optimizer (default: all)")
    planning.add_argument(
        "--adapters",
        help="comma-separated options of conf/adapter, in the order you prefer them (default: the config's "
        "own only): a candidate's adapter ranks before its speed, so with none,lora,qlora full "
        "fine-tuning is the best whenever it fits; an adapter is picked for memory, not quality",
    )
    planning.add_argument(
        "--probe-steps",
        type=int,
        default=0,
        help="run K real steps (at least 4) of the top three and rank them by measured step time",
    )
    planning.add_argument("--json", action="store_true", help="every candidate as JSON, for scripts")
    planning.add_argument(
        "--device",
        choices=DEVICES,
        help="plan for this device, with its kernels (default: cuda where available, else cpu)",
    )
    planning.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help=f"share of the budget kept free for the allocator's fragmentation (default {DEFAULT_MARGIN})",
    )
    planning.add_argument(
        "--gpus",
        default="1",
        help="comma-separated numbers of GPUs, e.g. 1,8,64: above 1, FSDP over that many; the smallest "
        "that fits is proposed beside the single-device options (default: 1)",
    )
    _trace_flags(planning)
    planning.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    planning.set_defaults(handler=_plan)
    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except ConfigError as error:
        fail(str(error))


if __name__ == "__main__":
    main()
