"""The optimizer-state estimate (effitrain.memory.optimizer_state) at the edges of bitsandbytes' formula,
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
    assert (
        state["unorm_vec"].numel() == 1
    )  # LAMB's max_unorm (1.0, the only value it takes) > 0: one fp32 norm per tensor
    assert memory.optimizer_state_footprint(optimizer) == estimated


def test_a_two_state_subclass_with_its_own_init_state_has_no_estimate():
    model = torch.nn.Linear(64, 64)
    assert memory.estimate_optimizer_state(bnb.optim.AdEMAMix8bit(model.parameters())) is None  # 3 moments
    assert memory.estimate_optimizer_state(bnb.optim.Adam8bit(model.parameters())) is not None


def _measured_equals_estimated(model, optimizer, inputs):
    from effitrain import memory

    estimated = memory.estimate_optimizer_state(optimizer)
    assert estimated is not None
    model(inputs).float().sum().backward()
    optimizer.step()
    assert memory.optimizer_state_footprint(optimizer) == estimated
    return estimated


def test_apollo_s_right_projection_is_estimated_exactly():
    from effitrain.train.optim import build_optimizer
    from tests.helpers.run import compose

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 40), torch.nn.Linear(40, 6))
    cfg = compose(
        "optimizer=apollo", "optimizer.rank=4", "optimizer.scale_type=tensor", "+optimizer.proj_type=right"
    ).optimizer
    optimizer = build_optimizer(cfg, model, weight_decay=0.0)
    _measured_equals_estimated(model, optimizer, torch.randint(0, 50, (3, 5)))


class _Conv(torch.nn.Module):
    """A 3-D weight (out, in, kernel): Adafactor factors it over its last two dimensions."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 6, 3)

    def forward(self, x):
        return self.conv(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adafactor_factors_a_3d_weight_and_keeps_fp64_weights_state_in_fp64(dtype):
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    model = _Conv().to(dtype)
    optimizer = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    estimated = _measured_equals_estimated(model, optimizer, torch.randn(2, 4, 7, dtype=dtype))
    # weight 6x4x3: rows 6*4 and columns 6*3 of the second moment; bias 6: full; RMS per tensor
    assert estimated.elements == (24 + 18 + 1) + (6 + 1)
    assert estimated.bytes == estimated.elements * dtype.itemsize


def test_fused_adamw_keeps_an_fp32_step_where_plain_adamw_s_follows_an_fp64_default():
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the non-fused step counter takes the default dtype
    try:
        for fused, step_bytes in ((True, 4), (False, 8)):
            model = torch.nn.Linear(4, 3).float()
            optimizer = torch.optim.AdamW(model.parameters(), fused=fused)
            estimated = _measured_equals_estimated(model, optimizer, torch.randn(2, 4, dtype=torch.float32))
            assert estimated.bytes == 2 * 4 * 15 + 2 * step_bytes, fused  # 2 moments of 12 + 3, 2 steps
    finally:
        torch.set_default_dtype(previous)
