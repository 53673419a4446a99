"""``effitrain plan``: the fastest combination that fits a memory budget, before any GPU hour.

    effitrain plan --memory-budget 8GiB --effective-batch-size 32 model=distilbert_base_cased

For each optimizer and precision, micro batches that divide the effective batch are tried from the
largest down (accumulation follows), first without gradient checkpointing, then with it for the
micro batches too large to fit without; each step peak is predicted by ``effitrain estimate``'s
fake-tensor trace at the worst case (every sample ``max_length`` tokens). Candidates under the
budget are ranked by expected throughput: fewer accumulation steps first (bigger matmuls, fewer
optimizer-step overheads; a micro batch too small to fill a GPU can cost many times what it
saves), then no recomputation (checkpointing repeats each layer's forward: about a third more
FLOPs), then half precision before fp32 on CUDA (its tensor cores), then the optimizer's order in
conf/optimizer. ``--probe-steps K`` runs K real steps of the top three and ranks them by measured
step time instead.

``--adapters none,lora,qlora`` plans each adapter too (:func:`plan_adapters`); without it, the
config's own adapter only: an adapter changes what is trained, a choice of quality the user makes,
not a knob for speed. The adapter ranks first, in the order given: list full fine-tuning (``none``)
first and it is the best whenever it fits; an adapter is picked for memory, not quality.
"""

from __future__ import annotations

import re
import sys

from effitrain.config.errors import ConfigError
from effitrain.config.load import apply_effective_batch_size
from effitrain.config.model_spec import no_checkpointing
from effitrain.config.registry import group_options, installed_optimizers

# The share of the budget kept free: the allocator rounds every block up (512 bytes on CUDA) and
# cannot always reuse a freed block for a larger one, so what it reserves exceeds what tensors hold.
DEFAULT_MARGIN = 0.10

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """``8GiB``, ``500MiB``, ``24GB`` or a plain number of bytes.

    Raises:
        ConfigError: anything else.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in UNITS:
        raise ConfigError(f"--memory-budget={text!r} is invalid: give a size such as 8GiB, 500MiB or 24GB")
    return int(float(match.group(1)) * UNITS[unit])


def micro_batches(effective: int) -> list[int]:
    return [m for m in range(effective, 0, -1) if effective % m == 0]


def weights_fit(cfg, budget: int, budget_text: str, margin: float = DEFAULT_MARGIN) -> None:
    """Every candidate holds the model's weights: when they alone exceed the budget, say so at once
    instead of tracing candidates that cannot fit.

    Raises:
        ConfigError: one line naming the budget, the weights' size and the least budget that could do.
    """
    from effitrain.commands.estimate import meta_model
    from effitrain.memory.adapted import unpacked_4bit_bytes
    from effitrain.memory.count import params_footprint

    model = meta_model(cfg)
    weights = params_footprint(model).bytes - unpacked_4bit_bytes(model.config, cfg)
    if weights > budget * (1 - margin):
        raise ConfigError(
            f"--memory-budget={budget_text!r} is invalid: the model's weights alone take "
            f"{weights / 2**20:.1f} MiB (with the {margin:.0%} margin, --margin): give more than "
            f"{weights / (1 - margin) / 2**20:.1f}MiB"
        )


def plan(overrides: list[str], budget: int, effective: int | None = None, optimizers=None, precisions=None,
         checkpointing=(False, True), device: str = "cpu", margin: float = DEFAULT_MARGIN,
         gpus: int = 1):  # fmt: skip
    """Every traced candidate (dicts with the keys below), best first; those over budget last.

    A candidate fits when its run's peak (the largest of its first step, a later step and
    evaluation), predicted for ``device``'s kernels, is at most ``budget * (1 - margin)``.
    ``gpus`` above 1: FSDP over that many processes (``parallel=fsdp``), one rank's peak against the
    budget of one device; the effective batch is split over the processes.

    ``checkpointing``: the gradient checkpointing settings to try. With it on, only micro batches
    larger than the largest that fits without it are tried: recomputation only pays where it
    saves accumulation steps.
    """
    from effitrain.commands.estimate import estimate_memory
    from effitrain.config.compose import compose
    from effitrain.config.overrides import names, parse

    base = compose(overrides)
    usable = budget * (1 - margin)
    chosen = any(names(o, "gradient_checkpointing") for o in parse(overrides))
    if chosen:  # the user's own setting is the only one tried
        checkpointing = [bool(base.gradient_checkpointing)]
    elif no_checkpointing(base):  # a model class that cannot recompute its layers
        checkpointing = [False]
    checkpointing = sorted(set(checkpointing))  # without first: it decides which micro batches to try with
    effective = (
        effective
        or base.get("effective_batch_size")
        or base.micro_batch_size * base.gradient_accumulation_steps
    )
    # each candidate's micro batch comes from its effective batch: a given one would conflict with it
    overrides = [o.input_line for o in parse(overrides) if o.key_or_group != "micro_batch_size"]
    if gpus > 1:
        overrides.append("parallel=fsdp")
    optimizers = optimizers or installed_optimizers(group_options("optimizer"))
    cuda = device == "cuda"
    precisions = precisions or (["bf16", "fp16", "fp32"] if cuda else ["fp32", "bf16"])
    launcher = f"torchrun --nproc_per_node {gpus} train.py " if gpus > 1 else "python train.py "
    rows = []

    def trace(optimizer, precision, recompute, micro) -> dict:
        accumulation = effective // (micro * gpus)
        choice = [f"optimizer={optimizer}", f"precision={precision}", f"effective_batch_size={effective}",
                  f"gradient_accumulation_steps={accumulation}"]  # fmt: skip
        if recompute and not chosen:
            choice.append("gradient_checkpointing=true")
        cfg = compose(list(overrides) + choice)
        # micro_batch_size from the effective batch, as a run of that many processes derives it
        apply_effective_batch_size(cfg, gpus)
        sharded = {"world_size": gpus} if gpus > 1 else {}  # one device: the call as it always was
        [row] = estimate_memory(cfg, {optimizer: cfg.optimizer}, device=device, **sharded).values()
        if "unsupported" in row:  # an optimizer FSDP's sharded parameters refuse: no candidate
            print(f"effitrain plan: {row['unsupported']}", file=sys.stderr, flush=True)
            return {"fits": False, "gradient_accumulation_steps": accumulation}
        fits = row["run_peak_bytes"] <= usable
        rows.append({
            "optimizer": optimizer, "precision": precision, "micro_batch_size": micro,
            "gradient_accumulation_steps": accumulation, "gradient_checkpointing": recompute,
            "step_peak_bytes_predicted": row["step_peak_bytes"],
            "run_peak_bytes_predicted": row["run_peak_bytes"], "run_peak_predicted": row["run_peak"],
            "fits": fits, "gpus": gpus, "command": launcher + " ".join(list(overrides) + choice),
        })  # fmt: skip
        print(f"effitrain plan: {len(rows)} traced: {optimizer} {precision} micro {micro} x {accumulation}"
              f"{' recompute' if recompute else ''}: {row['run_peak_bytes'] / 2**20:.1f} MiB, "
              f"{'fits' if fits else 'over'}", file=sys.stderr, flush=True)  # fmt: skip
        return rows[-1]

    for precision in precisions:
        for optimizer in optimizers:
            fewest = None  # accumulation steps of the best fit without checkpointing
            for recompute in checkpointing:
                sizes = [m for m in micro_batches(effective // gpus)
                         if not (recompute and fewest is not None and effective // m >= fewest)]  # fmt: skip
                best = None  # the largest micro batch that fits
                for index, micro in enumerate(sizes):
                    row = trace(optimizer, precision, recompute, micro)
                    if row["fits"]:  # smaller micro batches fit too, and rank lower: no need to trace them
                        best = row
                        break
                    if index == 0 and len(sizes) > 2:
                        # memory grows with the micro batch: when the smallest is over budget too,
                        # none in between fits, and tracing them would only take time
                        best = trace(optimizer, precision, recompute, sizes.pop())
                        if not best["fits"]:
                            best = None
                            break
                if best is not None and not recompute:
                    fewest = best["gradient_accumulation_steps"]
    half_first = {"bf16": 0, "fp16": 0, "fp32": 1} if cuda else {"fp32": 0, "bf16": 1, "fp16": 1}
    rows.sort(key=lambda r: (not r["fits"], r["gradient_accumulation_steps"], r["gradient_checkpointing"],
                             half_first[r["precision"]], optimizers.index(r["optimizer"])))  # fmt: skip
    return rows


def plan_adapters(overrides: list[str], budget: int, adapters: list[str], **kwargs) -> list[dict]:
    """:func:`plan` for each of ``adapters`` (options of conf/adapter), its rows tagged ``adapter``
    and ranked by it, in the order given, after whether they fit: full fine-tuning listed first is the
    best whenever it fits, however much accumulation it needs, since an adapter trains fewer weights
    and is picked for memory, not quality. Within an adapter, :func:`plan`'s own order. An
    ``adapter=`` among ``overrides`` gives way to each of ``adapters``; ``adapter.*`` keys apply to all."""
    from effitrain.config.overrides import parse

    own = [o.input_line for o in parse(overrides) if o.key_or_group != "adapter"]
    rows = [
        {"adapter": adapter, **row}
        for adapter in adapters
        for row in plan([*own, f"adapter={adapter}"], budget, **kwargs)
    ]
    # a stable sort: plan's own order within each adapter
    return sorted(rows, key=lambda r: (not r["fits"], adapters.index(r["adapter"])))


def probe(rows: list[dict], overrides: list[str], steps: int, top: int = 3) -> list[dict]:
    """Run ``steps`` real optimizer steps of the ``top`` fitting candidates, each in a process of its
    own (:func:`effitrain.run.isolated.run_isolated`); rank them by the measured median step time (the
    others keep their order after them). A probe that fails (out of memory included) is recorded in
    its row's ``probe_status`` and the plan goes on."""
    from effitrain.run.isolated import run_isolated

    fitting = [r for r in rows if r["fits"] and r.get("gpus", 1) == 1][:top]  # probes run one process
    for row in fitting:
        summary = run_isolated([*row["command"].split()[2:], f"max_steps={steps}"])
        row["probe_status"] = summary["status"]
        row["step_s_measured"] = summary.get("speed/step_s_median") if summary["status"] == "ok" else None
        row["step_peak_bytes_measured"] = summary.get("mem/step_peak_bytes")
    measured = sorted((r for r in fitting if r.get("step_s_measured")), key=lambda r: r["step_s_measured"])
    return measured + [r for r in rows if r not in measured]


def plan_over_gpus(overrides: list[str], budget: int, budget_text: str, gpus: list[int], effective=None,
                   optimizers=None, device: str = "cpu", margin: float = DEFAULT_MARGIN, **search) -> list[dict]:  # fmt: skip
    """:func:`plan` for each number of GPUs in ``gpus``, fewest first: one device unsharded (when 1
    is among them), then FSDP over each larger number until one fits: the smallest that does is
    proposed beside the single-device options, and larger ones are not traced. Candidates that fit
    come first, on fewer GPUs first. ``search``: :func:`plan`'s ``precisions`` and ``checkpointing``.

    Raises:
        ConfigError: a number of GPUs below 1 or that does not divide the effective batch; the
            weights alone over budget when 1 is the only number.
    """
    from effitrain.config.compose import compose
    from effitrain.config.load import load

    base = compose(overrides)
    effective = (
        effective
        or base.get("effective_batch_size")
        or base.micro_batch_size * base.gradient_accumulation_steps
    )
    for count in gpus:
        if count < 1 or effective % count:
            raise ConfigError(
                f"--gpus={count} is invalid: give a number of GPUs, 1 or more, that divides the effective "
                f"batch ({effective} samples, --effective-batch-size)"
            )
    rows = []
    for count in sorted(set(gpus)):
        if count == 1:
            try:
                weights_fit(load(overrides, device=device, loads=False), budget, budget_text, margin)
            except ConfigError:
                if len(gpus) == 1:
                    raise
                continue  # one device cannot hold the weights: only sharded candidates
        found = plan(
            overrides, budget, effective, optimizers, device=device, margin=margin, gpus=count, **search
        )
        rows += found
        if count > 1 and any(row["fits"] for row in found):
            break
    rows.sort(key=lambda row: (not row["fits"], row["fits"] and row["gpus"]))  # stable: plan's order within
    return rows
