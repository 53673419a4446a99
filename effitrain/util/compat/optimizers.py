"""The private APIs of third-party optimizers effitrain uses: torchao's low-bit Adam (its base class,
the class choosing its moments), APOLLO's projector (an object saved by its attributes).
"""

from __future__ import annotations

from effitrain.util.compat.guard import private

# torchao's low-bit Adam and AdamW derive from this private base (``torchao.optim.adam``): the
# optimizer-state formula is found by it, by name, so that nothing imports torchao to look.
TORCHAO_ADAM_BASE = "torchao.optim.adam._AdamBase"


def torchao_moments_owner(optimizer):
    """The class in a torchao low-bit Adam's MRO that chooses its moments' tensor subclass (the one
    defining the private ``_subclass_zeros``: ``AdamW4bit``, ``Adam8bit``, ...; a user's subclass
    inherits it), whose name ends in the bits. Fallback: None (no formula: the state is not estimated)."""
    for cls in type(optimizer).__mro__:
        if "_subclass_zeros" in vars(cls):
            return cls if private("torchao", cls, "_subclass_zeros") is not None else None
    return None


def apollo_projector_state(projector) -> dict:
    """An APOLLO projector (``apollo_torch``'s ``GradientProjector``, a plain object) as a plain dict:
    its class's name under ``class`` and its attributes (its instance ``__dict__``: the random matrix,
    rank, seed, ...), which apollo_torch's optimizer state holds and ``torch.load(weights_only=True)``
    reads. Guarded by the release only: the attributes are whatever that release keeps."""
    private("apollo-torch", projector, "__dict__")  # warns on a release not checked
    return {"class": type(projector).__name__, **vars(projector)}


def apollo_projector(state: dict, classes: dict):
    """The projector :func:`apollo_projector_state` saved, made again: its class (by name, from
    ``classes``) with those attributes, its ``__init__`` not run (it would draw a new random matrix)."""
    attributes = dict(state)
    cls = classes[attributes.pop("class")]
    projector = cls.__new__(cls)
    vars(projector).update(attributes)
    return projector
