"""``effitrain plan``'s command: its flags checked, the search of :mod:`effitrain.commands.plan` run
over the adapters or numbers of GPUs asked for, the best candidates printed as a table (or every
one as JSON)."""

from __future__ import annotations

from effitrain.commands.options import check_adapter_options, check_optimizer_options, default_device
from effitrain.commands.plan import plan, plan_over_gpus
from effitrain.commands.plan_budget import parse_bytes, weights_fit
from effitrain.commands.plan_check import probe
from effitrain.commands.plan_levers import LEVER_RATES, TECHNIQUE
from effitrain.config.errors import ConfigError


def plan_command(args) -> None:
    """The fastest combination that fits ``args.memory_budget`` (``args``: the parsed flags of
    ``effitrain plan``), printed as a table, best first, or every candidate as JSON.

    Raises:
        ConfigError: a bad flag or configuration, or nothing that fits (one line).
    """
    import json

    from effitrain.config.load import load
    from effitrain.memory import MIB
    from effitrain.train.adapters.build import check_builds  # torch: only for the verb

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
        check_optimizer_options(optimizers)
    adapters = args.adapters.split(",") if args.adapters else None
    if adapters:
        check_adapter_options(adapters)
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
                chosen = load(
                    [*args.overrides, f"adapter={adapter}"], device=device, loads=False, builds=check_builds
                )
                weights_fit(chosen, budget, args.memory_budget, args.margin)
                fitting.append(adapter)
            except ConfigError as error:
                refused = error
        if not fitting:
            raise refused
        rows = plan(args.overrides, budget, args.effective_batch_size, optimizers, device=device,
                    margin=args.margin, adapters=fitting, **traces)  # fmt: skip
    else:
        load(args.overrides, device=device, loads=False, builds=check_builds)
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
    rates = LEVER_RATES[device]
    print(
        "at equal accumulation, levers rank by their cost per step: the FLOPs they recompute at "
        f"{rates['flops_per_s'] / 1e12:g} TFLOP/s"
        + (
            f", the bytes they offload at {rates['host_bytes_per_s'] / 1e9:g} GB/s each way"
            if device == "cuda"
            else ""
        )
    )
    if adapters:
        print(
            f"adapters ranked in the order given ({args.adapters}): an adapter is picked for memory, not quality"
        )
    print(
        (f"{'adapter':<9}" if adapters else "")
        + f"{'fits':<5}"
        + (f"{'gpus':<5}" if sharded else "")
        + f"{'optimizer':<13}{'precision':<10}{'micro':>6}{'accum':>6}{'step MiB':>10}"
        f"{'run MiB':>10}" + (f"{'step s':>8}" if args.probe_steps else "") + "  levers"
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
            f"{row['step_peak_bytes_predicted'] / MIB:>10.1f}{row['run_peak_bytes_predicted'] / MIB:>10.1f}"
            + (f"{step_s:>8}" if args.probe_steps else "")
            + "  "
            + (" ".join(TECHNIQUE[key].override(value) for key, value in row["levers"].items()) or "none")
        )
    if len(shown) < len(rows):
        print(f"({len(rows) - len(shown)} more over budget; --json lists them)")
    print(f"effitrain plan: best: {rows[0]['command']}")
