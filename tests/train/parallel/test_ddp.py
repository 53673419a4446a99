"""``parallel=ddp``'s object (effitrain/train/parallel/ddp.py): the model as it is, and its checkpoint
files, written by rank 0 alone and read back exactly."""

from __future__ import annotations

import torch

from effitrain.train.parallel import ddp
from effitrain.train.parallel.ddp import DDP


def trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_apply_leaves_the_model_as_it_is():
    model = torch.nn.Linear(2, 2)
    said = []
    assert DDP().apply(model, None, torch.device("cpu"), said.append) is model and said == []


def test_a_checkpoint_reads_back_the_weights_and_the_optimizer_state(tmp_path):
    model, optimizer = trained(0)
    DDP().save(model, optimizer, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "optimizer.pt"]
    other, other_optimizer = trained(1)
    DDP().load(other, other_optimizer, tmp_path)
    for mine, theirs in zip(model.parameters(), other.parameters()):
        assert torch.equal(mine, theirs)
        assert torch.equal(optimizer.state[mine]["exp_avg"], other_optimizer.state[theirs]["exp_avg"])
    assert other_optimizer.state[next(other.parameters())]["step"].item() == 1


def test_only_rank_0_writes(tmp_path, monkeypatch):
    """Every rank holds the same model: the others write nothing."""
    monkeypatch.setattr(ddp, "rank", lambda: 1)
    DDP().save(*trained(0), tmp_path)
    assert list(tmp_path.iterdir()) == []
