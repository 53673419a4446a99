"""``effitrain plan``: the fastest combination that fits a memory budget, before any GPU hour.

    effitrain plan --memory-budget 8GiB --effective-batch-size 32 model=distilbert_base_cased

For each optimizer and precision, micro batches that divide the effective batch are tried from the
largest down (accumulation follows), first with no memory lever, then with each lever of
:mod:`effitrain.config.techniques` (gradient checkpointing of every second block and of every
block, activation offloading, chunked cross-entropy, the optimizer step in backward: each where the
model, task and device profile can take it, :mod:`effitrain.commands.plan_levers`) for the micro batches too large
to fit without; each step peak is predicted by ``effitrain estimate``'s fake-tensor trace at the
worst case (every sample ``max_length`` tokens). Candidates under the budget are ranked by expected
throughput: fewer accumulation steps first (bigger matmuls, fewer optimizer-step overheads; a micro
batch too small to fill a GPU can cost many times what it saves), then the least lever cost (the
FLOPs its replay recomputes and the bytes it offloads, in seconds at its stated rates), then half
precision before fp32 on CUDA (its tensor cores), then the config's own optimizer, then the
optimizer's order in conf/optimizer. ``--probe-steps K`` runs K real steps of
the top three and ranks them by measured step time instead.

bf16 and fp16 are replayed alike (:data:`HALF`): a candidate in the second half precision takes the
figures of the same candidate in the first, replayed once (``trace_source`` :data:`HALF_TWIN`).

``--adapters none,lora,qlora`` plans each adapter too (one more axis); without it, the
config's own adapter only: an adapter changes what is trained, a choice of quality the user makes,
not a knob for speed. The adapter ranks first, in the order given: list full fine-tuning (``none``)
first and it is the best whenever it fits; an adapter is picked for memory, not quality.
"""

from __future__ import annotations

import sys

from effitrain.commands.plan_budget import DEFAULT_MARGIN, MIB, held_at_update, weights_fit
from effitrain.commands.plan_levers import TECHNIQUE, lever_cost, lever_settings
from effitrain.config.errors import ConfigError
from effitrain.config.load import apply_effective_batch_size
from effitrain.config.registry import group_options, installed_optimizers
from effitrain.config.techniques import GRADIENT_CHECKPOINTING, OPTIMIZER_IN_BACKWARD, check_techniques

# The half precisions a replay cannot tell apart: autocast's op lists, the element size and the kernels
# (effitrain.memory.cuda) are the same for both, so are their bytes in every category
# (tests/commands/test_plan.py holds each lever's to a full replay of each); what differs is a grad
# scaler's few scalars, which neither replay models.
HALF = ("bf16", "fp16")
HALF_TWIN = "the other half precision's"


def micro_batches(effective: int) -> list[int]:
    return [m for m in range(effective, 0, -1) if effective % m == 0]


def plan(overrides: list[str], budget: int, effective: int | None = None, optimizers=None, precisions=None,
         checkpointing=None, device: str = "cpu", margin: float = DEFAULT_MARGIN, cache: bool = False,
         share: bool = True, gpus: int = 1, adapters: list[str] | None = None):  # fmt: skip
    """Every traced candidate (dicts with the keys below), best first; those over budget last.

    A candidate fits when its run's peak (the largest of its first step, a later step and
    evaluation), predicted for ``device``'s kernels, is at most ``budget * (1 - margin)``, less
    cuBLAS's workspaces on ``cuda`` (:data:`effitrain.memory.cuda.CUBLAS_WORKSPACES_BYTES`).
    ``gpus`` above 1: FSDP over that many processes (``parallel=fsdp``), one rank's peak against the
    budget of one device; the effective batch is split over the processes.

    ``checkpointing``: the gradient checkpointing settings to try (default: off, every second
    block, every block). With a lever on, only micro batches larger than the largest that fits
    without one are tried: a lever only pays where it saves accumulation steps. Every lever is tried
    at its largest micro batch before any at a smaller one, and none at more accumulation steps than
    a fit found already (it would rank below it). A lever a candidate cannot take (the optimizer
    step in backward with accumulation) is not traced for it.

    Candidates that differ only in the optimizer share one replay of their forward and backward
    (``share``), and traces come from the disk cache where kept (``cache``): each row's
    ``trace_source`` says how (:mod:`effitrain.memory.trace_cache`). The best candidate is then
    replayed in full, alone and uncached, and must give the same bytes (``confirmed_by_full_replay``).
    """
    from itertools import product

    from tqdm.auto import tqdm

    from effitrain.commands.estimate import estimate_memory
    from effitrain.config.compose import compose
    from effitrain.config.overrides import parse
    from effitrain.memory.cuda import CUBLAS_WORKSPACES_BYTES
    from effitrain.memory.fake_window import reused_in_search
    from effitrain.memory.shared_traces import StepReplays

    base = compose(overrides)
    usable = budget * (1 - margin) - (CUBLAS_WORKSPACES_BYTES if device == "cuda" else 0)
    settings = lever_settings(base, overrides, checkpointing, device)  # [{}]: no lever, tried first
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
    # the axes a forward and backward depend on, each searched over; the optimizer shares them
    axes = {"adapter": adapters} if adapters else {}
    axes["precision"] = precisions
    rows = []
    sizes = micro_batches(effective // gpus)

    def accumulation(micro: int) -> int:  # the rest of the effective batch, over every process
        return effective // (micro * gpus)

    progress = tqdm(total=len(list(product(*axes.values()))) * len(optimizers) * len(settings) * len(sizes),
                    desc="effitrain plan", unit="candidate", dynamic_ncols=True, disable=False)  # fmt: skip
    # traced: a replay of its own or shared by optimizers; derived: its optimizer step's figures from an
    # earlier candidate's identical step, or the other half precision's figures; cached: from the disk;
    # skipped: cannot fit or rank higher
    counts = dict.fromkeys(("traced", "derived", "cached", "skipped"), 0)
    counted = {"cached": "cached", "shared, step reused": "derived", HALF_TWIN: "derived"}
    steps = StepReplays()  # each optimizer's step, replayed once for every candidate it fits
    composed = {}  # (the setting's values, optimizer) -> its config, composed once
    candidates = {}  # (those, levers, micro batch) -> the candidate's config
    known = {}  # what the search counted once and reuses (effitrain.memory.fake_window.reused_in_search)

    def choice_of(setting, optimizer, levers=0, micro=None) -> list[str]:
        choice = [f"optimizer={optimizer}", *(f"{axis}={value}" for axis, value in setting.items())]
        if micro is not None:
            choice += [
                f"effective_batch_size={effective}",
                f"gradient_accumulation_steps={accumulation(micro)}",
            ]
        return choice + [TECHNIQUE[key].override(value) for key, value in settings[levers].items()]

    def config_of(setting, optimizer, levers=0, micro=None):
        """The candidate's config, from one composition per setting and optimizer."""
        key = tuple(setting.values()), optimizer
        if key not in composed:
            composed[key] = compose(list(overrides) + choice_of(setting, optimizer))
        if micro is None:
            return composed[key]
        if (key, levers, micro) not in candidates:  # a deep copy of a composed config: once each
            candidates[key, levers, micro] = candidate_config(
                composed[key], effective, accumulation(micro), settings[levers], gpus
            )
        return candidates[key, levers, micro]

    floors, said = {}, {}  # setting's values -> optimizer -> its counted row; what was said: its bytes
    halves = {}  # a half-precision candidate's (setting, levers, micro, optimizers) -> its rows

    def half_key(setting, names_, levers, micro):
        """Where a candidate in a half precision files its rows for the other (None: not half)."""
        if setting["precision"] not in HALF:
            return None
        values = tuple(HALF if axis == "precision" else value for axis, value in setting.items())
        return values, levers, micro, tuple(names_)

    def over_floor(setting, names_, levers) -> list[str]:
        """Of ``names_``, those whose counted weights, gradients (not with the update in backward) and
        optimizer state, all held at every update, alone exceed the budget: said once, not traced."""
        key = tuple(setting.values())
        if key not in floors:
            nodes = {name: config_of(setting, name).optimizer for name in optimizers}
            floors[key] = estimate_memory(config_of(setting, optimizers[0]), nodes, step=False, device=device,
                                          cache=cache, share=share)  # fmt: skip
        in_backward = settings[levers].get(OPTIMIZER_IN_BACKWARD.key, False)
        over = []
        for name in names_:
            held = held_at_update(floors[key][name], in_backward, gpus)
            if held > usable:
                over.append(name)
                if (key, name, in_backward) not in said:
                    said[(key, name, in_backward)] = held, " ".join(choice_of(setting, name, levers))
                    progress.write(f"effitrain plan: {said[(key, name, in_backward)][1]} cannot fit: its weights, "
                                   f"gradients and optimizer state alone are {held / MIB:.1f} MiB (a usable "
                                   f"{usable / MIB:.1f} MiB); not traced", file=sys.stderr)  # fmt: skip
        return over

    def trace(setting, names_, levers, micro) -> dict:
        """The candidates of ``names_`` (optimizers) at this setting, micro batch and levers: one
        shared replay (or the cache)."""
        first = config_of(setting, names_[0], levers, micro)
        try:
            check_techniques(first)  # a lever this candidate cannot take (the step in backward with
        except ConfigError:  # accumulation): no candidate, nothing traced
            return {name: {"fits": False, "refused": True} for name in names_}
        over = over_floor(setting, names_, levers)
        names_ = [name for name in names_ if name not in over]
        if not names_:
            return {name: {"fits": False, "refused": True} for name in over}
        first = config_of(setting, names_[0], levers, micro)
        # an optimizer's node reads no micro batch, accumulation or lever
        nodes = {name: config_of(setting, name).optimizer for name in names_}
        twin = half_key(setting, names_, levers, micro)
        if twin in halves:
            found = {name: {**row, "trace_source": HALF_TWIN} for name, row in halves[twin].items()}
        else:
            found = estimate_memory(first, nodes, device=device, cache=cache, share=share, steps=steps,
                                    world_size=gpus)  # fmt: skip
            if twin is not None:
                halves[twin] = found
        traced = {}
        for name, row in found.items():
            if "unsupported" in row:  # an optimizer FSDP's sharded parameters refuse: no candidate
                progress.write(f"effitrain plan: {row['unsupported']}", file=sys.stderr)  # stdout: --json's
                traced[name] = {"fits": False, "gradient_accumulation_steps": accumulation(micro)}
                continue
            fits = row["run_peak_bytes"] <= usable
            rows.append({
                **setting, "optimizer": name, "micro_batch_size": micro,
                "gradient_accumulation_steps": accumulation(micro),
                GRADIENT_CHECKPOINTING.key: first.get(GRADIENT_CHECKPOINTING.key),
                "levers": dict(settings[levers]), **lever_cost(row, accumulation(micro), device),
                "step_peak_bytes_predicted": row["step_peak_bytes"],
                "run_peak_bytes_predicted": row["run_peak_bytes"], "run_peak_predicted": row["run_peak"],
                "fits": fits, "gpus": gpus, "trace_source": row.get("trace_source"),
                "command": launcher + " ".join(list(overrides) + choice_of(setting, name, levers, micro)),
            })  # fmt: skip
            traced[name] = rows[-1]
            counts[counted.get(row.get("trace_source"), "traced")] += 1
        progress.set_postfix(counts, refresh=False)
        progress.update(len(found))
        return {**traced, **{name: {"fits": False, "refused": True} for name in over}}

    def search():
        """One optimizer's search at one setting: yields (levers, micro) to trace, is sent its row.
        Without a lever first, micro batches from the largest down; then every lever at its largest
        micro batch; then, for a lever that did not fit there, smaller ones, but none with more
        accumulation steps than a fit already found: it would rank below that fit."""
        fewest = None  # accumulation steps of the best fit without a lever
        found = None  # ... of the best fit, with a lever or without

        def largest_fitting(levers, tried, largest=None):
            """The row of the largest micro batch of ``tried`` that fits (None: none); ``largest``:
            the row of one larger, traced already."""
            best = None
            tried = [m for m in tried if not (levers and found is not None and accumulation(m) > found)]
            for index, micro in enumerate([None, *tried] if largest is not None else tried):
                row = largest if micro is None else (yield levers, micro)
                if row.get("refused"):  # this lever cannot take this micro batch: the next one
                    continue
                if row["fits"]:  # smaller micro batches fit too, and rank lower: no need to trace them
                    return row
                if index == 0 and len(tried) > (1 if largest is not None else 2):
                    # memory grows with the micro batch: when the smallest is over budget too,
                    # none in between fits, and tracing them would only take time
                    best = yield levers, tried.pop()
                    if best.get("refused") or not best["fits"]:
                        return None
            return best

        best = yield from largest_fitting(0, list(sizes))
        if best is not None:
            fewest = found = best["gradient_accumulation_steps"]
        left = {}  # a lever that did not fit at its largest micro batch -> its row and the smaller ones
        for levers in range(1, len(settings)):
            # a lever only pays where it saves accumulation steps
            tried = [m for m in sizes if fewest is None or accumulation(m) < fewest]
            if tried:
                row = yield levers, tried[0]
                if not row.get("refused") and row["fits"]:
                    found = min(accumulation(tried[0]), found or accumulation(tried[0]))
                else:
                    left[levers] = row, tried[1:]
        for levers, (row, tried) in left.items():
            best = yield from largest_fitting(levers, tried, row)
            if best is not None:
                steps = best["gradient_accumulation_steps"]
                found = min(steps, found or steps)

    try:
        with reused_in_search(known):  # FLOP counts and eval phases serve the candidates they do not depend on
            for values in product(*axes.values()):
                setting = dict(zip(axes, values))
                searches = {name: search() for name in optimizers}
                asked = {name: next(searches[name]) for name in optimizers}
                done = dict.fromkeys(optimizers, 0)
                while asked:  # the optimizers asking for the same candidate are traced together
                    wanted = next(iter(asked.values()))
                    together = [name for name, request in asked.items() if request == wanted]
                    for name, row in trace(setting, together, *wanted).items():
                        done[name] += 1
                        try:
                            asked[name] = searches[name].send(row)
                        except StopIteration:
                            del asked[name]
                            counts["skipped"] += len(settings) * len(sizes) - done[name]
                            progress.set_postfix(counts, refresh=False)
                            progress.update(len(settings) * len(sizes) - done[name])
    finally:
        progress.close()
    if not rows and said:  # every candidate over the floor: none traced, the smallest named
        held, choice = min(said.values())
        raise ConfigError(f"--memory-budget={budget / MIB:.1f}MiB is invalid: nothing fits; the smallest weights, "
                          f"gradients and optimizer state alone are {held / MIB:.1f} MiB ({choice}), "
                          f"{usable / MIB:.1f} MiB usable with the {margin:.0%} margin (--margin)")  # fmt: skip
    half_first = {"bf16": 0, "fp16": 0, "fp32": 1} if cuda else {"fp32": 0, "bf16": 1, "fp16": 1}
    # an adapter ranks first, in the order given: it is picked for memory, not speed (module docstring)
    adapter_rank = adapters.index if adapters else lambda adapter: 0
    # the config's own optimizer wins a tie: these rules say nothing between optimizers (a probe does),
    # and another optimizer learns otherwise; then the order of conf/optimizer
    own = base.hydra.runtime.choices.get("optimizer")
    rows.sort(key=lambda r: (not r["fits"], adapter_rank(r.get("adapter")), r["gradient_accumulation_steps"],
                             r["lever_cost_s"], len(r["levers"]), half_first[r["precision"]],
                             r["optimizer"] != own, optimizers.index(r["optimizer"])))  # fmt: skip
    if rows:
        from effitrain.commands.plan_check import confirm

        with reused_in_search(known):  # the FLOPs its search counted: the confirmation compares bytes
            confirm(rows[0], device)
    return rows


def candidate_config(base, effective: int, accumulation: int, levers: dict, gpus: int = 1):
    """``base`` (composed for a setting and an optimizer) with a candidate's effective batch and
    accumulation, its ``levers`` (technique key -> value) set, its micro batch derived as a run of
    ``gpus`` processes derives it: what composing those overrides gives, as plain keys set on a copy
    (Hydra's composition takes a quarter of a second; ``tests/commands/test_plan.py`` holds the two
    equal)."""
    import copy

    from omegaconf import open_dict

    cfg = copy.deepcopy(base)
    with open_dict(cfg):
        cfg.effective_batch_size, cfg.gradient_accumulation_steps = effective, accumulation
        for key, value in levers.items():
            cfg[key] = value
    apply_effective_batch_size(cfg, gpus)
    return cfg


def plan_over_gpus(overrides: list[str], budget: int, budget_text: str, gpus: list[int], effective=None,
                   optimizers=None, device: str = "cpu", margin: float = DEFAULT_MARGIN, **search) -> list[dict]:  # fmt: skip
    """:func:`plan` for each number of GPUs in ``gpus``, fewest first: one device unsharded (when 1
    is among them), then FSDP over each larger number until one fits: the smallest that does is
    proposed beside the single-device options, and larger ones are not traced. Candidates that fit
    come first, on fewer GPUs first. ``search``: :func:`plan`'s ``precisions``, ``checkpointing``,
    ``cache`` and ``share``.

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
