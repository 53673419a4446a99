"""The private APIs of third-party optimizers in effitrain/util/compat/optimizers.py (torchao, APOLLO),
each against the installed release."""

from __future__ import annotations

import pytest
import torch

from effitrain.util import compat


def test_an_apollo_projector_is_saved_by_its_attributes_and_made_again():
    from effitrain.train.apollo import PROJECTORS, APOLLOAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 48)
    optimizer = APOLLOAdamW(model.parameters(), rank=4, update_proj_gap=1)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    projector = optimizer.state[model.weight]["projector"]
    state = compat.apollo_projector_state(projector)
    assert state["class"] == "GradientProjector"
    assert {k: state[k] for k in ("rank", "update_proj_gap", "proj_type", "scale")} == {
        "rank": 4,
        "update_proj_gap": 1,
        "proj_type": "std",
        "scale": 1.0,
    }
    assert tuple(state["ortho_matrix"].shape) == (48, 4)  # the random matrix, m x rank (std, m < n)
    made = compat.apollo_projector(state, PROJECTORS)
    assert type(made) is type(projector) and set(vars(made)) == set(vars(projector))
    assert torch.equal(made.ortho_matrix, projector.ortho_matrix) and made.seed == projector.seed
    assert "class" in state  # the saved dict is left as it was


def test_torchao_s_low_bit_adam_is_found_by_its_private_base_and_moments_owner():
    torchao_optim = pytest.importorskip("torchao.optim")  # the torchao extra; not installed in dev

    param = torch.nn.Parameter(torch.ones(4096))

    class Mine(torchao_optim.AdamW4bit):
        pass

    for cls in (torchao_optim.AdamW4bit, Mine):
        optimizer = cls([param])
        assert compat.TORCHAO_ADAM_BASE in {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}
        assert compat.torchao_moments_owner(optimizer) is torchao_optim.AdamW4bit
    assert compat.torchao_moments_owner(torchao_optim.Adam8bit([param])).__name__ == "Adam8bit"
    assert compat.torchao_moments_owner(torch.optim.AdamW([param])) is None
