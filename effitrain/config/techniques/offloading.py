"""Activation offloading (``activation_offloading=true``): the tensors the forward saves for backward
go to host memory (pinned, copied on a side stream) and come back in backward, as torchtune's and
TRL's activation offloading do. Device memory falls by what is offloaded; host memory holds it, and
each byte crosses the host link twice per step. ``N``: only saved tensors of N bytes or more (``true``:
1,024, torchtune's default minimum). Bit-identical to ``false`` (the copies are exact). With
gradient checkpointing the checkpointed blocks' inputs are what is offloaded.

    python train.py activation_offloading=true
    python train.py activation_offloading=1048576 gradient_checkpointing=true   # 1 MiB and larger

On a CPU run the host is the device: nothing is copied (a run says so in one line), and memory
is as with it off. The CUDA profile (``effitrain estimate --device cuda``) replays the copies:
the device's categories leave them out and ``host_offloaded`` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from effitrain.config.errors import invalid
from effitrain.config.parallel import shards

# torchtune's OffloadActivations(min_offload_size=1024): smaller tensors are not worth a copy.
DEFAULT_MINIMUM = 1024


@dataclass(frozen=True)
class ActivationOffloading:
    """The technique (:class:`effitrain.config.techniques.Technique`) of ``activation_offloading``."""

    key: str = "activation_offloading"
    allowed: str = (
        "must be true, false or a minimum tensor size in bytes N >= 1"  # also a value of the wrong type
    )

    def check(self, cfg: DictConfig) -> None:
        """``true``, ``false`` or a minimum tensor size in bytes N >= 1; on, without torch.compile
        (its graphs are not run under the hooks) and without parallel=fsdp (its per-rank prediction
        does not split off the host copies).

        Raises:
            ConfigError: another value, or a combination it is not built for.
        """
        value = cfg.get(self.key)
        if not isinstance(value, bool) and (not isinstance(value, int) or value < 1):
            raise invalid(self.key, value, self.allowed)
        if value is False:
            return
        if cfg.compile.enabled:
            raise invalid(
                self.key, value, "torch.compile is not run under its hooks: give false or compile=off"
            )
        if shards(cfg):
            raise invalid(
                self.key,
                value,
                "parallel=fsdp's per-rank prediction does not count the host copies: give false",
            )

    def minimum(self, cfg: DictConfig) -> int | None:
        """The smallest saved tensor offloaded, in bytes: 1,024 for ``true``, N for N, None when off."""
        value = cfg.get(self.key)
        return None if value is False or value is None else (DEFAULT_MINIMUM if value is True else int(value))

    def apply(self, model, cfg: DictConfig, autocast=None) -> None:
        """The model's forward under the offloading hooks (:mod:`.offload_hooks`). A CPU run (no CUDA
        device, not a replay of one) gets none: its host is its device, and it says so once."""
        minimum = self.minimum(cfg)
        if minimum is None:
            return
        import torch

        from effitrain.config.techniques.offload_hooks import forced, offloaded_forward
        from effitrain.util.compat import is_fake

        if not torch.cuda.is_available() and not forced():
            if not any(is_fake(p) for p in model.parameters()):  # the run, not its replay
                print(
                    f"effitrain: {self.described(cfg)} is a no-op on this CPU run: the host is the "
                    "device, nothing is offloaded (memory as with it off)",
                    flush=True,
                )
            return
        offloaded_forward(model, minimum)

    def replay_key(self, cfg: DictConfig) -> dict:
        minimum = self.minimum(cfg)
        return {} if minimum is None else {self.key: minimum}

    def plan_values(self, cfg: DictConfig, given: bool, asked=None, device: str = "cpu") -> list:
        """Off, then on (``asked``: the values to try, off among them); the user's own setting alone
        when given; off alone for the CPU's profile (``device``), where it saves nothing."""
        if given:
            return [cfg.get(self.key)]
        if device == "cpu":
            return [False]
        asked = (False, True) if asked is None else asked
        return sorted({False, *asked}, key=lambda value: (value is not False, value))

    def recomputes(self, cfg: DictConfig) -> bool:
        return False  # it copies what the forward saved; nothing is computed again

    def override(self, value) -> str:
        if isinstance(value, bool) or value is None:
            return f"{self.key}={str(bool(value)).lower()}"
        return f"{self.key}={int(value)}"

    def described(self, cfg: DictConfig) -> str:
        return self.override(cfg.get(self.key))


ACTIVATION_OFFLOADING = ActivationOffloading()
