"""Parallel strategies (``parallel=ddp|fsdp``): one object per choice, asked questions where a run,
an estimate or a checkpoint needs an answer, so no module outside this package tests the name.

    strategy = strategy_of(cfg)
    model = strategy.apply(model, cfg, device)       # before the optimizer: it holds what this makes
    strategy.shards                                   # does each process hold part of the model?

A strategy is a module here with one object (:class:`Strategy`); its checks, which the config layer
runs before anything loads, are torch-free in :mod:`effitrain.config.parallel`. Adding one:
docs/extending.md ("Adding a parallel strategy").
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, Protocol

from effitrain.train.parallel.ddp import DDP
from effitrain.train.parallel.fsdp import FSDP


class Strategy(Protocol):
    """What every parallel strategy answers."""

    name: str  # the ``parallel.strategy`` that chooses it
    shards: bool  # each process holds a part of the weights, gradients and optimizer state

    def check(self, cfg, device: str | None = None) -> None:
        """Its combinations with the other groups and the machine (ConfigError, one line each)."""

    def apply(self, model, cfg, device, say: Callable[[str], None] = ...):
        """``model`` made this strategy's on ``device``, before the optimizer is built."""

    def batches_per_process(self, batches: int, processes: int) -> int:
        """Of ``batches`` per epoch, how many one process trains on."""

    def save(self, model, optimizer, folder: Path) -> None:
        """Weights and optimizer state into a checkpoint's ``folder``; every rank calls it."""

    def load(self, model, optimizer, folder: Path) -> None:
        """What :meth:`save` wrote, back into ``model`` and ``optimizer``; every rank calls it."""


class Sharding(Strategy, Protocol):
    """A strategy that ``shards``: what the one-rank replay (:mod:`effitrain.memory.sharded`) asks."""

    def apply_on_mesh(self, model, cfg, mesh):
        """``model`` sharded over ``mesh`` (the real one, or a fake process group's)."""

    def no_sync(self, model) -> AbstractContextManager:
        """A micro-batch's backward without the gradients' collective (all but a window's last)."""

    def replay_refusal(self, optimizer_cfg) -> str | None:
        """Why ``optimizer_cfg``'s update cannot run on this strategy's parameters, or None."""


STRATEGIES: dict[str, Strategy] = {strategy.name: strategy for strategy in (DDP(), FSDP())}


def strategy_of(cfg) -> Strategy:
    """The strategy ``cfg.parallel.strategy`` names (the schema allows only these names)."""
    return STRATEGIES[str(cfg.parallel.strategy)]
