"""A sharded checkpoint reads back exactly, and no file of it can run code (a planted ``.metadata`` or a
planted value), neither when it is loaded nor when a resume examines it."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from effitrain.train import resume_point, sharded_checkpoint
from effitrain.train.sharded_checkpoint import (
    UnsafeCheckpoint,
    load_sharded,
    read_model_state,
    refusal,
    save_sharded,
)
from effitrain.util.atomic import sha256


class Payload:
    """Unpickling it creates the file ``path``: what a planted pickle would do, harmlessly."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mknod, (self.path,)


@pytest.fixture
def group():
    """A process group of one (gloo), as a ``parallel=fsdp`` run without a launcher gets."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        torch.distributed.destroy_process_group()


def trained(mesh, seed):
    """A sharded two-layer model and its AdamW after one step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def local(tensor):
    return tensor.to_local().clone() if hasattr(tensor, "to_local") else tensor.clone()


def test_what_is_saved_loads_back_bit_identical(group, tmp_path):
    model, optimizer = trained(group, seed=0)
    save_sharded(model, optimizer, tmp_path)
    other, other_optimizer = trained(group, seed=1)  # other weights, other moments
    assert refusal(tmp_path) is None
    load_sharded(other, other_optimizer, tmp_path)
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(local(a), local(b)), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(local(optimizer.state[a][key]), local(other_optimizer.state[b][key])), key


def planted_folder(mesh, folder, marker, where):
    """A checkpoint with a pickle that creates ``marker`` when unpickled: as ``.metadata`` or as the
    optimizer's lr (a value DCP stores pickled), with a whole ``effitrain.json`` rewritten to match."""
    model, optimizer = trained(mesh, seed=0)
    if where == "metadata":
        save_sharded(model, optimizer, folder)
        (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        optimizer_state["param_groups"][0]["lr"] = Payload(marker)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    files = sorted(p.name for p in folder.iterdir())
    meta = {"format": resume_point.FORMAT, "step": 1, "files": {n: (folder / n).stat().st_size for n in files},
            "sha256": {n: sha256(folder / n) for n in files}}  # fmt: skip
    (folder / resume_point.META).write_text(json.dumps(meta))
    return model, optimizer


@pytest.mark.parametrize("where", ["metadata", "a value"])
def test_a_planted_pickle_is_refused_and_never_run(group, tmp_path, where):
    folder, marker = tmp_path / "step-00000001", tmp_path / "ran"
    folder.mkdir()
    model, optimizer = planted_folder(group, folder, marker, where)
    assert resume_point.read_meta(folder) is not None  # sizes and checksums match: only its content tells
    meta, why = resume_point.examine(folder)
    assert meta is None and "not a checkpoint effitrain could have written" in why
    assert "os.mknod" in why or "posix.mknod" in why  # the global it refused, named
    with pytest.raises(UnsafeCheckpoint):
        load_sharded(model, optimizer, folder)
    with pytest.raises(UnsafeCheckpoint):  # effitrain export's reader
        read_model_state(folder)
    assert not marker.exists()
    # the same folder read by DCP's own reader runs the payload: what the reader above prevents
    if where == "metadata":
        from torch.distributed.checkpoint import FileSystemReader

        with pytest.raises(AttributeError):  # the payload's result (None) is no Metadata, but it ran
            FileSystemReader(folder).read_metadata()
        assert marker.exists()


def test_the_whole_model_is_read_without_its_optimizer_state(group, tmp_path):
    """``effitrain export``'s reader: every parameter whole (FSDP's own full_tensor), nothing else."""
    model, optimizer = trained(group, seed=0)
    save_sharded(model, optimizer, tmp_path)
    state = read_model_state(tmp_path)
    expected = {name: p.full_tensor() for name, p in model.named_parameters()}
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[name], expected[name]) for name in expected)


def test_the_reader_itself_refuses_a_planted_metadata(group, tmp_path, monkeypatch):
    """Without the check made up front, the reader DCP is handed still unpickles nothing but DCP's
    classes: a folder planted after the check runs no code either."""
    folder, marker = tmp_path / "step-00000001", tmp_path / "ran"
    folder.mkdir()
    planted_folder(group, folder, marker, "metadata")
    monkeypatch.setattr(sharded_checkpoint, "refusal", lambda folder: None)
    # DCP gathers its reader's refusals into one error of its own (an AssertionError, inside a
    # CheckpointException where a group exists), which names ours
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(
        (UnsafeCheckpoint, AssertionError, CheckpointException),
        match=r"\.metadata holds a pickled (os|posix)\.mknod",
    ):
        read_model_state(folder)
    assert not marker.exists()
