"""effitrain: memory- and speed-efficient fine-tuning of Hugging Face transformers.

  effitrain train optimizer=adam8bit         one run (the same as python train.py)
  effitrain check -m optimizer=adamw,lion    validate a run or a sweep, run nothing
  effitrain compare multirun/<study>/<time>  verdict, table, plots, one HTML page
  effitrain estimate model=tiny              a run's memory by category, beforehand
  effitrain plan --memory-budget 8GiB        the fastest combination that fits
  effitrain export outputs/<date>/<time>     a finished run as a plain transformers model folder

'effitrain <command> --help' tells more about one command.
"""
# This docstring is the --help text, so it is plain text; the Hydra side is effitrain/commands/train_command.py.

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from effitrain.commands.check import check
from effitrain.commands.estimate_command import estimate
from effitrain.commands.export import export
from effitrain.commands.plan_budget import DEFAULT_MARGIN
from effitrain.commands.plan_command import plan_command
from effitrain.commands.train_command import train
from effitrain.config.errors import ConfigError, fail
from effitrain.config.schema import DEVICES


def _compare(args) -> None:
    """``effitrain compare``: the comparison is the compare package's, beside commands on its layer
    (so its dispatch is here); a report that cannot be written is one line."""
    from effitrain.compare import compare

    try:
        compare(args.folders, args.output, args.wandb_mode)
    except OSError as error:  # a report file that cannot be written: one line, not a traceback
        where = args.output or args.folders[0]
        raise ConfigError(
            f"--output={str(where)!r} is invalid: cannot be written ({error.strerror})"
        ) from None


def _trace_flags(parser) -> None:
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="trace again rather than read (and write) the traces kept in $EFFITRAIN_CACHE_DIR/traces",
    )
    parser.add_argument(
        "--no-share",
        action="store_true",
        help="a full replay per optimizer, nothing shared and every micro-batch replayed (slower, the same bytes: what sharing is checked against)",
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # everything after it is Hydra's: overrides, -m, --cfg job, ...
        train(argv[1:])
        return
    if argv[:1] == ["check"] and not {"-h", "--help"} & set(argv):  # -m may come first: not argparse's
        try:
            check(argv[1:])
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
    check_flags = commands.add_parser(
        "check",
        help="validate a run's configuration (or every job of a sweep, with -m) without running it",
        description="Compose and validate the configuration train.py would run, and run nothing: every "
        "problem is one line naming the key, its value and what is allowed (exit code 2).",
    )
    check_flags.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="Hydra overrides, as for train.py (-m: every job of a sweep)",
    )
    check_flags.set_defaults(handler=lambda args: check(args.overrides))
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
    estimating = commands.add_parser(
        "estimate",
        help="predict a run's memory by category, for every optimizer, before running it",
        description="Predict the memory of the run these overrides describe, for every optimizer of "
        "conf/optimizer: weights, gradients, optimizer state, activations and temporaries at the step "
        "peak, and the run's peak by phase. The model is built from its config on the meta device and "
        "one step is replayed on fake tensors at the worst case (every sample max_length tokens): no "
        "weights or data are loaded and nothing is allocated.",
    )
    estimating.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    estimating.add_argument("--json", action="store_true", help="exact bytes as JSON, for scripts")
    estimating.add_argument(
        "--device",
        choices=DEVICES,
        help="predict what this device holds, with its kernels (default: cuda where available, else cpu)",
    )
    estimating.add_argument(
        "--optimizers", help="comma-separated options of conf/optimizer to estimate (default: all)"
    )
    estimating.add_argument(
        "--world-size",
        type=int,
        help="with parallel=fsdp: predict one rank of this many processes (default 1)",
    )
    _trace_flags(estimating)
    estimating.set_defaults(handler=estimate)
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
    planning.set_defaults(handler=plan_command)
    exporting = commands.add_parser(
        "export",
        help="a finished run's final weights as a plain transformers model folder (from_pretrained loads it)",
        description="Write a finished run's final weights as a plain transformers model folder (config, "
        "safetensors weights, tokenizer) that from_pretrained loads without effitrain: an adapter is "
        "merged into its base, a sharded checkpoint joined. The run needs a checkpoint of its last "
        "step (checkpoint_every=N); the folder is written whole or not at all, never over another.",
    )
    exporting.add_argument("run", type=Path, help="the run's folder (its hydra.run.dir, or a job of a sweep)")
    exporting.add_argument(
        "--out", type=Path, help="the model folder to write, new or empty (default: <run>/export)"
    )
    exporting.set_defaults(handler=export)
    # options and overrides mix in any order (argparse alone stops taking a positional list at the
    # first option: `estimate parallel=fsdp --world-size 2 model=tiny` left model=tiny unrecognized)
    args, rest = parser.parse_known_args(argv)
    if rest:
        if any(a.startswith("-") for a in rest) or not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *rest]
    try:
        args.handler(args)
    except ConfigError as error:
        fail(str(error))


def console_script() -> None:
    """The ``effitrain`` command: :func:`main` on the process's arguments, the process then ending as
    :mod:`effitrain.util.process_exit` says."""
    from effitrain.util.process_exit import run_then_end

    run_then_end(main, sys.argv[1:])


if __name__ == "__main__":
    console_script()
