"""``effitrain estimate``'s command: its flags checked, the estimate of every optimizer (the engine:
:mod:`effitrain.commands.estimate`) printed as two tables, the step peak by category and the
run's peak by phase, or as JSON."""

from __future__ import annotations

import time

from effitrain.commands.options import check_optimizer_options, default_device
from effitrain.config import techniques
from effitrain.config.compose import compose
from effitrain.config.errors import ConfigError


def estimate(args) -> None:
    """Static memory of the run these overrides describe, for every option of the optimizer group
    (``args``: the parsed flags of ``effitrain estimate``), printed as tables or, with ``--json``, exact
    bytes.

    Raises:
        ConfigError: a bad flag or configuration, or no optimizer predicted (one line).
    """
    import json

    from effitrain.commands.estimate import estimate_memory
    from effitrain.config.load import load

    # `optimizer=X` marks the chosen row; `optimizer.key=value` applies to that row only, since
    # the other optimizers may have no such key.
    from effitrain.config.overrides import names, parse
    from effitrain.config.registry import group_options, installed_optimizers
    from effitrain.memory import MIB
    from effitrain.train.adapters.build import check_builds  # torch: only for the verb

    parsed = parse(args.overrides)
    base = [o.input_line for o in parsed if not names(o, "optimizer")]
    own = [o.input_line for o in parsed if names(o, "optimizer") and o.key_or_group != "optimizer"]
    device = args.device or default_device()
    if args.optimizers:
        check_optimizer_options(args.optimizers.split(","))
    # validated as check does, for the device predicted for; the data and weights are never read
    cfg = load(args.overrides, device=device, loads=False, builds=check_builds)
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
    if cfg.activation_offloading is not False:  # the host's figure, apart from the device's step peak
        print(
            f"host memory: {first['step_peak_host_offloaded_bytes'] / MIB:.1f} MiB of offloaded activations "
            f"(host_offloaded, at the host's peak; {techniques.ACTIVATION_OFFLOADING.described(cfg)}), "
            "outside the step peak above"
            + (": none on a CPU, whose host is its device" if device == "cpu" else "")
        )
    for name, row in rows.items():
        if row["step_peak_bound"]:
            print(f"{name}: an upper bound of its step peak: {row['step_peak_bound']}")
    if first.get("step_peak_leaves_out"):
        print(f"the predicted step peak leaves out {first['step_peak_leaves_out']}")
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
    from effitrain.train.parallel import strategy_of

    sharded = strategy_of(cfg).shards
    if world_size is not None and not sharded:
        raise ConfigError(
            f"--world-size={world_size} is invalid with parallel={cfg.parallel.strategy}: only parallel=fsdp "
            "shards (every data-parallel rank holds what one process holds)"
        )
    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size={world_size} is invalid: expected a number of processes, 1 or more")
    return (world_size or 1) if sharded else None
