"""Gradient checkpointing (``gradient_checkpointing=true``): each block's activations are dropped after
its forward and recomputed in backward, in transformers' non-reentrant form (exact gradients, and it
works with torch.compile and DDP). Less activation memory for about a third more FLOPs; ``plan``
turns it on only where it saves accumulation steps. Selective (``gradient_checkpointing=N``): every
N-th block only (the first, the N+1-th, ...), as torchtitan's and torchtune's selective checkpointing
do, the others keeping their activations: memory and compute between none and all.

    python train.py gradient_checkpointing=true
    python train.py gradient_checkpointing=2        # every second block
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from effitrain.config.errors import ConfigError, invalid


@dataclass(frozen=True)
class GradientCheckpointing:
    """The technique (:class:`effitrain.config.techniques.Technique`) of ``gradient_checkpointing``."""

    key: str = "gradient_checkpointing"

    def check(self, cfg: DictConfig) -> None:
        """``true``, ``false`` or a block interval N >= 1; on, with a model class that can recompute
        its layers, known from the config alone.

        Raises:
            ConfigError: N below 1; a model class without transformers' gradient checkpointing.
        """
        value = cfg.get(self.key)
        if not isinstance(value, bool) and (not isinstance(value, int) or value < 1):
            raise invalid(self.key, value, "must be true, false or N >= 1 (recompute every N-th block)")
        unable = self.unable(cfg) if value else None
        if unable:
            raise invalid(self.key, value, f"{unable} cannot recompute activations: give false")

    def every(self, cfg: DictConfig) -> int | None:
        """Every how many blocks one is recomputed: 1 for ``true``, N for N, None when off."""
        value = cfg.get(self.key)
        return None if value is False or value is None else (1 if value is True else int(value))

    def unable(self, cfg: DictConfig) -> str | None:
        """The name of the model class the task builds when it does not support gradient checkpointing
        (transformers' ``supports_gradient_checkpointing``), from the model's config alone; None when
        it does or the class is not known before loading (remote code: :meth:`apply` then says so)."""
        import transformers

        from effitrain.config.model_spec import task_mapping

        _, model_type, mapping = task_mapping(cfg)
        name = (mapping or {}).get(model_type)
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        return name if cls is not None and not cls.supports_gradient_checkpointing else None

    def apply(self, model, cfg: DictConfig, autocast=None) -> None:
        """Recompute each layer's activations in backward where ``cfg`` says so. A decoder's key/value
        cache is switched off first, as transformers would do with a warning on each run. ``autocast``
        (the CUDA replay's emulated autocast): checkpointing recomputes a layer under the autocast its
        forward ran in (it saves and restores autocast state); the emulated one is a mode, not that
        state, so it is opened around the checkpointed function itself, in forward and recomputation
        alike.

        Raises:
            ConfigError: a model that cannot recompute its layers; under ``autocast``, one whose
                checkpointed function transformers does not expose.
        """
        every = self.every(cfg)
        if every is None:
            return
        from effitrain.util.compat import checkpointing_wrapped, recomputation_tracked

        if not getattr(model, "supports_gradient_checkpointing", False):
            raise invalid(
                self.key,
                cfg.get(self.key),
                f"{type(model).__name__} cannot recompute activations: give false",
            )
        if getattr(model.config, "use_cache", False):
            model.config.use_cache = False
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 renamed it; every N-th block
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every
            )
        elif every > 1:
            raise invalid(
                self.key, every, "recomputing every N-th block needs transformers >= 5: give true or false"
            )
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpointing_wrapped(model, recomputation_tracked)  # a step tracker sees the whole recomputed layer
        if autocast is not None and not checkpointing_wrapped(model, autocast):
            raise ConfigError(
                "the CUDA replay cannot recompute this model's layers under CUDA's autocast "
                "(no transformers _gradient_checkpointing_func): gradient checkpointing with "
                f"precision={cfg.precision.mixed_precision} is not modeled"
            )

    def replay_key(self, cfg: DictConfig) -> dict:
        every = self.every(cfg)
        return {self.key: every is not None if every in (None, 1) else every}

    def plan_values(self, cfg: DictConfig, given: bool, asked=None, device: str = "cpu") -> list:
        """Off, then every second block, then every block (``asked``: a subset; without first: it
        decides which micro batches are tried with it); the user's own setting alone when given;
        off alone for a model class that cannot recompute."""
        if given:
            return [cfg.get(self.key)]
        if self.unable(cfg):
            return [False]
        order = (False, 2, True)
        asked = order if asked is None else asked
        return [value for value in order if any(value is a or (value == a and type(a) is int) for a in asked)]

    def recomputes(self, cfg: DictConfig) -> bool:
        return self.every(cfg) is not None

    def override(self, value) -> str:
        if isinstance(value, bool) or value is None or value == 1:
            return f"{self.key}={str(bool(value)).lower()}"
        return f"{self.key}={int(value)}"

    def described(self, cfg: DictConfig) -> str:
        return self.override(cfg.get(self.key))


GRADIENT_CHECKPOINTING = GradientCheckpointing()
