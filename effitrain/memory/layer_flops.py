"""A step's FLOPs counted on fewer blocks of the same model, where that gives the whole model's count
exactly: on a 32-layer model the count is a replay of its own, as long as a memory replay, while a
fake tensor's operator costs the same whatever its sizes.

``FlopCounterMode`` sums the FLOPs of a step's matrix products, which their shapes decide. A model
whose blocks are all alike runs the same products in each block, so its count is
``outside + blocks * per_block``: affine in the number of blocks. With gradient checkpointing of
every N-th block, what is recomputed repeats every N blocks, so the count is affine in groups of N.
The count is made at one, two and three groups and extrapolated. Where the three do not lie on a
line, the whole model is counted. So is a model whose config lists differing kinds of blocks
(``layer_types``: sliding and full attention, say) or whose blocks are not all built alike, one
whose blocks do not split into whole groups, and one of six groups or fewer (the three counts would
build as many blocks as it has). ``tests/memory/test_layer_flops.py`` holds the extrapolated counts
equal to whole ones.
"""

from __future__ import annotations

import copy

GROUPS = (1, 2, 3)  # the numbers of groups of blocks counted: two make the line, the third checks it


def per_layer_lists(config, layers: int) -> dict[str, list]:
    """The attributes of ``config`` that hold one entry per block (``layer_types`` and the like)."""
    return {
        name: list(value)
        for name, value in vars(config).items()
        if isinstance(value, (list, tuple)) and len(value) == layers
    }


def blocks_alike(model, layers: int) -> bool:
    """Whether ``model`` holds its ``layers`` blocks in module lists (one or more: an encoder's and a
    decoder's) whose blocks are all built alike: the same submodules, of the same classes, with
    parameters and buffers of the same shapes and dtypes (a model whose first blocks are dense and
    the rest mixtures of experts is not)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    return bool(lists) and all(len({_built(block) for block in blocks}) == 1 for blocks in lists)


def _built(block) -> tuple:
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return (
        tuple((name, type(module).__name__) for name, module in block.named_modules()),
        tuple((name, tuple(tensor.shape), str(tensor.dtype)) for name, tensor in tensors),
    )


def smaller(config, layers: int):
    """A copy of ``config`` with ``layers`` blocks, its per-block lists cut to them."""
    lists = per_layer_lists(config, config.num_hidden_layers)
    cut = copy.deepcopy(config)
    cut.num_hidden_layers = layers
    for name, value in lists.items():
        setattr(cut, name, value[:layers])
    return cut


def alike(config, model=None) -> bool:
    """Whether every block of ``config``'s model is of one kind: by the config's per-block lists
    (``layer_types``), and as built (:func:`blocks_alike`; ``model`` None skips that check)."""
    layers = config.num_hidden_layers
    if any(len({repr(entry) for entry in value}) > 1 for value in per_layer_lists(config, layers).values()):
        return False
    return model is None or blocks_alike(model, layers)


def counted_by_groups(config, count_with, whole, period: int = 1, model=None) -> int:
    """A step's FLOPs for ``config``'s model: from ``count_with(smaller_config)`` at one, two and
    three groups of ``period`` blocks, extrapolated to its ``num_hidden_layers``; ``whole()`` where
    that would not be exact (module docstring). ``model``: the whole model as built, whose blocks
    must be alike (:func:`blocks_alike`); None skips that check (a caller without one)."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers % period or layers <= sum(GROUPS) * period:
        return whole()  # blocks not in whole groups, or no fewer counted than the model has
    if not alike(config, model):
        return whole()  # blocks of more than one kind, by the config or as built
    one, two, three = (count_with(smaller(config, groups * period)) for groups in GROUPS)
    if three - two != two - one:
        return whole()
    return one + (layers // period - 1) * (two - one)
