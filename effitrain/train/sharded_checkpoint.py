"""A sharded model's checkpoint (``parallel=fsdp``): ``torch.distributed.checkpoint`` files, each rank
writing its own shards, read back without running code from any file.

DCP's own reader unpickles the folder's ``.metadata`` (``pickle.load``) and every value that is not a
tensor (the optimizer's ``param_groups``: ``torch.load(weights_only=False)``). Anyone who can write the
folder could plant a pickle there, rewrite ``effitrain.json``'s checksum and size to match, and have
``resume=auto`` run it. Here ``.metadata`` is read by an unpickler that builds DCP's own metadata
classes and nothing else (:class:`MetadataUnpickler`), and every other value with
``weights_only=True``, as the tensors already are. :func:`refusal` reads both the same way before a
checkpoint is chosen, so a planted one is skipped and named like a damaged one.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

METADATA = ".metadata"  # DCP's file name for the checkpoint's layout

# What a DCP ``.metadata`` pickle builds, and nothing else: DCP's dataclasses, the torch values they
# hold (a Size, a dtype, a layout by name) and the checkpoint's path. A name DCP renames upstream is
# refused as well, loudly: tests/train/test_sharded_checkpoint.py reads a real checkpoint through it.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file holds a pickled object a checkpoint never holds (code, or anything else)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, refusing every global outside :data:`_ALLOWED` (a dtype is
    ``torch.<name>`` and is allowed when it is one)."""

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"{METADATA} holds a pickled {module}.{name}, which a checkpoint never holds")


def read_metadata(folder: Path):
    """The checkpoint's layout (DCP's ``Metadata``), read by :class:`MetadataUnpickler`."""
    with open(Path(folder) / METADATA, "rb") as handle:
        return MetadataUnpickler(handle).load()


def _values_only(value: io.BytesIO):
    """A value that is not a tensor, read with ``weights_only=True`` (numbers, strings, containers)."""
    try:
        return torch.load(value, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as error:
        # torch's message is a page of advice; its one line that names the refused global is the reason
        said = [line for line in str(error).splitlines() if "GLOBAL" in line] or [str(error).splitlines()[0]]
        raise UnsafeCheckpoint(f"a value that is not a tensor is not plain data: {said[0].strip()}") from None


def refusal(folder: Path) -> str | None:
    """Why the sharded checkpoint in ``folder`` must not be loaded (a file holds more than data), or None.
    Reads ``.metadata`` and every value that is not a tensor as :func:`load_sharded` does."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        metadata = read_metadata(folder)
        for index, info in (metadata.storage_data or {}).items():
            if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                continue
            with open(Path(folder) / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                _values_only(io.BytesIO(handle.read(info.length)))
    except (pickle.UnpicklingError, OSError, EOFError, AttributeError, TypeError, ValueError) as error:
        return f"it is not a checkpoint effitrain could have written ({error})"
    return None


def save_sharded(model, optimizer, folder: Path) -> None:
    """A sharded model's weights and optimizer state, each rank writing its own shards into
    ``folder`` (``torch.distributed.checkpoint``; every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)


def _safe_loading(planner_base):
    """DCP's file reader and ``planner_base`` (a load planner class), made to run no code from the
    folder: ``.metadata`` read by :class:`MetadataUnpickler`, every value that is not a tensor with
    ``weights_only=True`` and handed on as the pickle of that plain data (what DCP unpickles is ours)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # per-rank metadata files: effitrain never writes them
                raise UnsafeCheckpoint("a per-rank metadata file was asked for")
            metadata = read_metadata(Path(self.checkpoint_id))
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # as DCP's reader does
            return metadata

    class Planner(planner_base):
        def load_bytes(self, read_item, value):
            plain = io.BytesIO()
            torch.save(_values_only(value), plain)
            plain.seek(0)
            super().load_bytes(read_item, plain)

    return Reader, Planner


def _refuse_unsafe(folder: Path) -> None:
    why = refusal(folder)
    if why is not None:  # said plainly here; the reader and planner hold it again while DCP reads
        raise UnsafeCheckpoint(f"{folder}: {why}")


def load_sharded(model, optimizer, folder: Path) -> None:
    """What :func:`save_sharded` wrote, read into this rank's shards (every rank calls it) by DCP's own
    loader with the reader and planner of :func:`_safe_loading`: no file's content is run as code.

    Raises:
        UnsafeCheckpoint: ``.metadata`` or a value holds a pickled object other than plain data.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _refuse_unsafe(folder)
    Reader, Planner = _safe_loading(DefaultLoadPlanner)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, storage_reader=Reader(folder), planner=Planner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def read_model_state(folder: Path) -> dict:
    """The whole model's weights of a sharded checkpoint, every rank's shards joined into one state
    dict in this process (no process group), as DCP's ``dcp_to_torch_save`` joins them, but read
    through :func:`_safe_loading` and without the optimizer's state: what ``effitrain export`` saves.

    Raises:
        UnsafeCheckpoint: ``.metadata`` or a value holds a pickled object other than plain data.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _refuse_unsafe(folder)
    Reader, Planner = _safe_loading(_EmptyStateDictLoadPlanner)
    state: dict = {}
    _load_state_dict(state, storage_reader=Reader(folder), planner=Planner(keys={"model"}), no_dist=True)
    return state["model"]
