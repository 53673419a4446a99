"""``effitrain plan``'s lever axis: which memory levers a search tries (:func:`lever_settings`) and what
each candidate's levers cost per step (:func:`lever_cost`, at :data:`LEVER_RATES`), for
:mod:`effitrain.commands.plan` to rank candidates of equal accumulation by."""

from __future__ import annotations

import math

from effitrain.config.techniques import GRADIENT_CHECKPOINTING, TECHNIQUES

TECHNIQUE = {technique.key: technique for technique in TECHNIQUES}

# What a lever's extra work is taken to cost, per device profile, to rank candidates of equal
# accumulation (the output states them): recomputed FLOPs at a sustained rate (about 40% of an
# H100's dense bf16 peak on CUDA; a CPU's rate only orders recomputation against itself there), and
# offloaded bytes out and back at the host link's bandwidth (PCIe 5.0 x16's ~25 GB/s each way
# achieved with pinned memory; nothing moves on a CPU, where the host is the device).
LEVER_RATES = {
    "cuda": {"flops_per_s": 400e12, "host_bytes_per_s": 25e9},
    "cpu": {"flops_per_s": 100e9, "host_bytes_per_s": math.inf},
}


def lever_settings(base, overrides: list[str], checkpointing=None, device: str = "cpu") -> list[dict]:
    """The levers plan tries, each a ``{technique key: value}`` set on a candidate: none first (what
    the config says), then each technique's values alone (gradient checkpointing's from
    ``checkpointing``), then gradient checkpointing of every block with each other lever. A
    technique the user gives on the command line is theirs: never searched, never overridden."""
    from effitrain.config.overrides import names, parse

    given = {t.key for t in TECHNIQUES for o in parse(overrides) if names(o, t.key)}
    singles = []
    for technique in TECHNIQUES:
        if technique.key in given:
            continue
        asked = checkpointing if technique is GRADIENT_CHECKPOINTING else None
        _, *on = technique.plan_values(base, False, asked, device)
        singles += [{technique.key: value} for value in on]
    recompute = {GRADIENT_CHECKPOINTING.key: True}
    paired = [
        {**recompute, **lever}
        for lever in singles
        if recompute in singles and GRADIENT_CHECKPOINTING.key not in lever
    ]
    return [{}, *singles, *paired]


def lever_cost(row: dict, accumulation: int, device: str) -> dict:
    """A candidate's levers' extra work per optimizer step (its estimate ``row``): the FLOPs they
    recompute (from the replay), the bytes offloaded to the host and back (every micro-batch's
    saved tensors, the replay's host figure), and the seconds both take at :data:`LEVER_RATES`."""
    rates = LEVER_RATES[device]
    recomputed = row.get("recomputed_flops_per_step") or 0
    offloaded = 2 * accumulation * (row.get("step_peak_host_offloaded_bytes") or 0)
    return {
        "recomputed_flops": recomputed,
        "offloaded_bytes": offloaded,
        "lever_cost_s": recomputed / rates["flops_per_s"] + offloaded / rates["host_bytes_per_s"],
    }
