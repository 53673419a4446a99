"""Memory techniques: root config keys that trade compute (or host memory) for device memory, each
one module here, the one place to read and change it, as torchtune keeps activation offloading in
``training/_activation_offloading.py``.

    python train.py gradient_checkpointing=true                        # recompute blocks in backward
    effitrain plan --memory-budget 8GiB model=distilbert_base_cased    # tries it off, then on

A technique is an object with the four parts of :class:`Technique`: its check (run by
:func:`effitrain.config.validate.validate`, before anything heavy is loaded), what it applies to the
built model (in training, :mod:`effitrain.run.build`, and in the replay on fake tensors,
:mod:`effitrain.memory.replay` and :mod:`effitrain.memory.sharded`: one code path, so what is
predicted is what runs), the entries its replay is cached under (:mod:`effitrain.memory.trace_cache`)
and its values as an axis of ``plan`` (:mod:`effitrain.commands.plan`). Every caller asks
:data:`TECHNIQUES` (or a member by name); none reads a technique's key itself.

This package sits in the config layer because the check must: it imports no torch at module level
(the config layer's checks are torch-free); what it applies imports torch and transformers inside
the function that applies it. docs/extending.md lists the files a new technique touches.
"""

from __future__ import annotations

from typing import Protocol

from omegaconf import DictConfig

from effitrain.config.techniques.checkpointing import GRADIENT_CHECKPOINTING
from effitrain.config.techniques.chunked_loss import LOSS_CHUNKS
from effitrain.config.techniques.in_backward import OPTIMIZER_IN_BACKWARD
from effitrain.config.techniques.offloading import ACTIVATION_OFFLOADING


class Technique(Protocol):
    """One memory technique, named by its root config key."""

    key: str  # its root key in conf/config.yaml, typed in effitrain.config.schema.RunConfig

    def check(self, cfg: DictConfig) -> None:
        """Raises ConfigError, one line naming the key, the value and what is allowed, for a value
        this run cannot take."""

    def apply(self, model, cfg: DictConfig, autocast=None) -> None:
        """What it does to the built model (before an adapter wraps it or FSDP shards it), in a run
        and in the replay alike; ``autocast``: the replay's emulated CUDA autocast, a mode rather
        than torch's autocast state, for a technique that reruns a forward in backward to reopen."""

    def replay_key(self, cfg: DictConfig) -> dict:
        """What a trace of ``cfg`` depends on from this technique: entries of the trace cache's key."""

    def plan_values(self, cfg: DictConfig, given: bool, asked=None, device: str = "cpu") -> list:
        """Its values as an axis of ``plan``, the value that leaves it off first: ``asked`` (or its
        own) unless the user ``given`` the key on the command line (their value alone) or the model,
        or ``device``'s profile, cannot take them (off alone)."""

    def recomputes(self, cfg: DictConfig) -> bool:
        """Whether it repeats forward work in backward in ``cfg``: the replay then counts the FLOPs
        it adds (:attr:`effitrain.memory.replay.Trace.recomputed_flops`), plan's cost of it."""

    def override(self, value) -> str:
        """``key=value`` as a command line gives it (plan's commands)."""

    def described(self, cfg: DictConfig) -> str:
        """Its setting in ``cfg``, as estimate's line says it."""


TECHNIQUES: tuple[Technique, ...] = (
    GRADIENT_CHECKPOINTING,
    ACTIVATION_OFFLOADING,
    LOSS_CHUNKS,
    OPTIMIZER_IN_BACKWARD,
)


def check_techniques(cfg: DictConfig) -> None:
    """Every technique's check of ``cfg``.

    Raises:
        ConfigError: the first technique's value this run cannot take, in one line.
    """
    for technique in TECHNIQUES:
        technique.check(cfg)


def apply_techniques(model, cfg: DictConfig, autocast=None) -> None:
    """Every technique ``cfg`` turns on, applied to ``model`` (see :meth:`Technique.apply`)."""
    for technique in TECHNIQUES:
        technique.apply(model, cfg, autocast)


def recomputing(cfg: DictConfig) -> bool:
    """Whether any technique ``cfg`` turns on repeats forward work in backward."""
    return any(technique.recomputes(cfg) for technique in TECHNIQUES)


def replay_keys(cfg: DictConfig) -> dict:
    """The entries of every technique in the key a trace of ``cfg`` is cached under."""
    return {entry: value for technique in TECHNIQUES for entry, value in technique.replay_key(cfg).items()}


def described(cfg: DictConfig) -> str:
    """The techniques' settings in ``cfg``, as estimate's line says them: gradient checkpointing's
    always (``gradient_checkpointing=false``), each other's where it is on (its value is not the one
    its plan axis starts with)."""
    return ", ".join(
        technique.described(cfg)
        for technique in TECHNIQUES
        if technique is GRADIENT_CHECKPOINTING
        or technique.described(cfg) != technique.override(technique.plan_values(cfg, False)[0])
    )


__all__ = [
    "ACTIVATION_OFFLOADING",
    "GRADIENT_CHECKPOINTING",
    "LOSS_CHUNKS",
    "OPTIMIZER_IN_BACKWARD",
    "TECHNIQUES",
    "Technique",
    "apply_techniques",
    "check_techniques",
    "described",
    "recomputing",
    "replay_keys",
]
