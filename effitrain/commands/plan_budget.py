"""``effitrain plan``'s budget: its parsing, the share kept free, and what cannot fit before any
candidate is traced: the model's weights alone (:func:`weights_fit`, at once), or an optimizer's
weights, gradients and state, all held at every update (:func:`held_at_update`, plan's floor: such
a candidate is said and never replayed)."""

from __future__ import annotations

import re

from effitrain.config.errors import ConfigError

# The share of the budget kept free: the allocator rounds every block up (512 bytes on CUDA) and
# cannot always reuse a freed block for a larger one, so what it reserves exceeds what tensors hold.
DEFAULT_MARGIN = 0.10

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
MIB = UNITS["MIB"]


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


def held_at_update(counted: dict, in_backward: bool, gpus: int = 1) -> int:
    """What every update holds of a candidate, from ``estimate``'s counted row (``step=False``): its
    weights, all its gradients (none whole with the update in backward) and its optimizer state; a
    rank of ``gpus`` its share or more (FSDP's counted totals are the whole model's)."""
    row = {key.removeprefix("whole_model_"): value for key, value in counted.items()}
    grads = 0 if in_backward else row["grads_bytes"]
    return (row["weights_bytes"] + grads + (row["optimizer_state_bytes"] or 0)) // gpus


def weights_fit(cfg, budget: int, budget_text: str, margin: float = DEFAULT_MARGIN) -> None:
    """Every candidate holds the model's weights: when they alone exceed the budget, say so at once
    instead of tracing candidates that cannot fit.

    Raises:
        ConfigError: one line naming the budget, the weights' size and the least budget that could do.
    """
    from effitrain.commands.estimate import meta_model
    from effitrain.memory.count import params_footprint
    from effitrain.train.adapters.replay import unpacked_4bit_bytes

    model = meta_model(cfg)
    weights = params_footprint(model).bytes - unpacked_4bit_bytes(model.config, cfg)
    if weights > budget * (1 - margin):
        raise ConfigError(
            f"--memory-budget={budget_text!r} is invalid: the model's weights alone take "
            f"{weights / MIB:.1f} MiB (with the {margin:.0%} margin, --margin): give more than "
            f"{weights / (1 - margin) / MIB:.1f}MiB"
        )
