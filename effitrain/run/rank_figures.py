"""Every rank's own memory figures, in ``summary_ranks.json`` beside rank 0's ``summary.json``.

Each process of a run measures what it holds: under ``parallel=fsdp`` its shards of weights,
gradients and optimizer state, and its step peak by category, which differ between ranks where a
dimension does not divide by the world size (the last rank's rows are part padding). Rank 0's
figures are the summary's; the file lists every rank's, in rank order.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from effitrain.train.distributed import world_size
from effitrain.util.atomic import write_atomic

RANKS = "summary_ranks.json"


def rank_figures(figures: dict, rank: int) -> dict:
    """The figures that are one rank's own: its memory (``mem/*``), with its rank."""
    return {"env/rank": rank, **{key: value for key, value in figures.items() if key.startswith("mem/")}}


def write_rank_figures(output_dir: Path, figures: dict, rank: int) -> None:
    """Gather every rank's :func:`rank_figures` on rank 0 and write them; every rank calls it (a
    collective), and only in a run of several processes."""
    if world_size() == 1:
        return
    gathered = [None] * world_size()
    torch.distributed.all_gather_object(gathered, rank_figures(figures, rank))
    if rank == 0:
        write_atomic(Path(output_dir) / RANKS, json.dumps(gathered, indent=2, sort_keys=True) + "\n")
