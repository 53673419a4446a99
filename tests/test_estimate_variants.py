"""The optimizer-state estimate (effitrain.memory.estimate) at the edges of bitsandbytes' formula,
each against what a real step allocates: a tensor of exactly ``min_8bit_size`` elements, the
``max_unorm`` buffer, and a subclass whose own ``init_state`` the formula does not describe."""

from __future__ import annotations

import pytest
import torch

from effitrain import memory

bnb = pytest.importorskip("bitsandbytes")


def test_8bit_lamb_at_the_size_limit_with_max_unorm_is_estimated_exactly():
    # LAMB8bit: a two-state optimizer of the same formula that keeps a max_unorm norm buffer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10))  # 4096 weights: the limit
    optimizer = bnb.optim.LAMB8bit(model.parameters(), lr=1e-3, min_8bit_size=4096)
    estimated = memory.estimate_optimizer_state(optimizer)
    model(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    state = optimizer.state[model[0].weight]
    assert state["state1"].dtype == torch.uint8  # exactly min_8bit_size elements: 8-bit
    assert optimizer.state[model[1].weight]["state1"].dtype == torch.float32  # 640: under it
    assert state["unorm_vec"].numel() == 1  # LAMB's max_unorm (1.0, the only value it takes) > 0: one fp32 norm per tensor
    assert memory.optimizer_state_footprint(optimizer) == estimated


def test_a_two_state_subclass_with_its_own_init_state_has_no_estimate():
    model = torch.nn.Linear(64, 64)
    assert memory.estimate_optimizer_state(bnb.optim.AdEMAMix8bit(model.parameters())) is None  # 3 moments
    assert memory.estimate_optimizer_state(bnb.optim.Adam8bit(model.parameters())) is not None
