"""Memory counted exactly: the bytes of the distinct storages behind a set of tensors.

A tied or shared weight, or the quantization map bitsandbytes hands to every parameter's state, is
counted once; a tensor subclass (torchao, DTensor, ...) is counted by the plain tensors it is made
of, not by ``element_size()``; an object in optimizer state (APOLLO's projector) by the tensors among
its attributes. Python numbers in optimizer state (the ``step`` of Adafactor and
8-bit Adam) hold no tensor memory: they are left out of the bytes and reported apart, as a count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIB = 2**20


@dataclass(frozen=True)
class Footprint:
    """Memory held by a set of tensors, each distinct storage counted once."""

    bytes: int = 0
    elements: int = 0
    storages: int = 0
    python_values: int = 0  # non-tensor leaves (ints, floats): no tensor memory

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int]:
        return (self.bytes, self.elements, self.storages, self.python_values)

    @classmethod
    def of(cls, storages: dict, python_values: int = 0) -> Footprint:
        """From ``{storage key: (bytes, elements)}``, one entry per distinct storage."""
        return cls(
            bytes=sum(b for b, _ in storages.values()),
            elements=sum(e for _, e in storages.values()),
            storages=len(storages),
            python_values=python_values,
        )


def _leaves(value):
    """Plain tensors and non-tensor leaves inside nested dicts/lists/tuples and tensor subclasses."""
    from effitrain.util.compat import is_traceable_wrapper_subclass

    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            # A wrapper subclass owns no storage: what it stores are its inner tensors.
            attributes, _ = value.__tensor_flatten__()
            for name in attributes:
                inner = getattr(value, name)
                if isinstance(inner, torch.Tensor):  # a DTensor lists its DeviceMesh too: not its data
                    yield from _leaves(inner)
        else:
            yield value
            # a bitsandbytes 4-bit weight (Params4bit) holds packed codes; its block scales (absmax,
            # the code and, double-quantized, the nested state's absmax, code and offset) are its
            # quant_state's tensors
            quant_state = getattr(value, "quant_state", None)
            if quant_state is not None:
                yield from (leaf for leaf in _leaves(quant_state) if isinstance(leaf, torch.Tensor))
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            yield from _leaves(item)
    elif value is not None:
        yield value
        if hasattr(value, "__dict__") and not isinstance(value, type):
            # an object kept in optimizer state (APOLLO's projector) is one Python value, and the
            # tensors among its attributes are tensor memory
            for item in vars(value).values():
                yield from (leaf for leaf in _leaves(item) if isinstance(leaf, torch.Tensor))


def storage_key(tensor: torch.Tensor):
    storage = tensor.untyped_storage()
    if storage.data_ptr() == 0:
        # No real memory (meta tensors, empty storages): tell tensors apart by identity.
        return (tensor.device, "id", id(tensor)), storage.nbytes()
    return (tensor.device, storage.data_ptr()), storage.nbytes()


def footprint(*values) -> Footprint:
    """Bytes and elements of the distinct storages behind every tensor in ``values`` (nested freely).

    A storage's elements are its bytes over the item size of the first tensor seen on it, so a view
    of part of a buffer counts the whole buffer, which is what stays allocated.
    """
    seen: dict = {}
    python_values = 0
    for leaf in _leaves(values):
        if not isinstance(leaf, torch.Tensor):
            python_values += 1
            continue
        key, nbytes = storage_key(leaf)
        if key not in seen:
            seen[key] = (nbytes, nbytes // leaf.element_size())
    return Footprint.of(seen, python_values)


def optimizer_state_footprint(optimizer) -> Footprint:
    """What ``optimizer.state`` holds now (quantization maps and absmax buffers included)."""
    return footprint(list(optimizer.state.values()))


def optimizer_params(optimizer) -> list[torch.Tensor]:
    """The distinct parameters an optimizer updates, in group order."""
    params, seen = [], set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def params_footprint(model: torch.nn.Module, trainable_only: bool = False) -> Footprint:
    """The model's weights (4-bit ones by what they hold); ``trainable_only``: those that train."""
    return footprint([p for p in model.parameters() if p.requires_grad or not trainable_only])
