"""torch's other private APIs of effitrain/util/compat/pytorch.py, each against the installed release."""

from __future__ import annotations

import pytest
import torch

from effitrain.util import compat


def test_fake_tensors_have_shapes_and_no_memory():
    with compat.fake_tensor_mode():
        tensor = torch.ones(1000, 1000)
        assert type(tensor).__name__ == "FakeTensor" and tensor.shape == (1000, 1000)


def test_outside_fake_mode_makes_real_tensors_under_a_fake_tensor_mode():
    with compat.fake_tensor_mode():
        assert compat.is_fake(torch.zeros(2))
        with compat.outside_fake_mode():
            inside = torch.ones(3)
            total = inside.sum().item()
        assert not compat.is_fake(inside) and total == 3.0


def test_wrapper_subclass_check():
    plain = torch.ones(3)
    assert compat.is_traceable_wrapper_subclass(plain) is False
    assert compat.is_traceable_wrapper_subclass(torch.nn.Parameter(plain)) is False


@pytest.mark.parametrize("fused", [None, False])
def test_adam_step_dtype_is_what_adam_allocates(fused):
    param = torch.nn.Parameter(torch.ones(4))
    kwargs = {"capturable": False} if fused is None else {"fused": fused}
    optimizer = torch.optim.Adam([param], **kwargs)
    param.grad = torch.ones(4)
    optimizer.step()
    assert optimizer.state[param]["step"].dtype == compat.adam_step_dtype(fused)


def test_compile_seconds_counts_dynamo_compilation():
    before = compat.compile_seconds()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    assert compiled(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert compat.compile_seconds() > before >= 0.0


def test_tree_map_reaches_every_leaf_of_a_call_s_arguments():
    args = (1, [2, {"k": 3}], {"m": (4,)})
    assert compat.tree_map(lambda x: x * 10, args) == (10, [20, {"k": 30}], {"m": (40,)})


@pytest.mark.parametrize("name", compat.SDPA_KERNEL_OPS)
def test_cuda_attention_kernel_ops_run_on_fake_tensors_and_return_the_logsumexp(name):
    # the replay's premise: each kernel is its own op whose meta function gives what backward keeps
    op = compat.sdpa_kernel_op(name)
    with compat.fake_tensor_mode():
        q, k, v = (torch.ones(2, 3, 5, 8, dtype=torch.float16) for _ in range(3))
        if name.endswith("flash_attention"):
            out, logsumexp = op(q, k, v, 0.0, False, False)[:2]
        else:
            out, logsumexp = op(q, k, v, None, True, 0.0, False)[:2]
    assert tuple(out.shape) == (2, 3, 5, 8) and out.dtype == torch.float16
    assert logsumexp.dtype == torch.float32 and tuple(logsumexp.shape)[:2] == (2, 3)


def test_fake_process_group_makes_this_process_a_rank_of_a_larger_world():
    compat.fake_process_group(rank=0, world_size=8)
    try:
        assert torch.distributed.get_world_size() == 8 and torch.distributed.get_rank() == 0
        tensor = torch.ones(2)
        torch.distributed.all_reduce(tensor)  # returns at once, moves nothing
        assert tensor.tolist() == [1.0, 1.0]
    finally:
        torch.distributed.destroy_process_group()


def test_batch_norm_classes_are_torch_s_base_of_every_batch_norm(monkeypatch):
    """The base class, so a batch norm of any name is one (``optim.param_groups``: no weight decay)."""
    from torch.nn.modules import batchnorm

    from effitrain.train.optim import param_groups

    assert compat.batch_norm_classes() == (batchnorm._BatchNorm,)
    layers = [
        torch.nn.BatchNorm1d(4),
        torch.nn.BatchNorm2d(4),
        torch.nn.SyncBatchNorm(4),
        torch.nn.LazyBatchNorm1d(),
    ]
    assert [isinstance(layer, compat.batch_norm_classes()) for layer in layers] == [True] * 4

    class Whitening(torch.nn.BatchNorm1d):  # no "norm" in its name
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), Whitening(4))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert [p.shape for p in decay["params"]] == [(4, 4)] and len(no_decay["params"]) == 2
    monkeypatch.setitem(compat.CHECKED_BELOW, "torch", "2.0")  # the fallback: torch's public classes
    fallback = compat.batch_norm_classes.__wrapped__()
    assert torch.nn.SyncBatchNorm in fallback and isinstance(torch.nn.BatchNorm3d(2), fallback)


def test_an_optimizer_built_for_a_check_leaves_dynamo_unimported_and_a_later_one_wrapped():
    """In a fresh process: AdamW built inside ``dynamo_left_unimported`` imports no torch._dynamo
    (the 2-3 s a check saves); one built after it imports dynamo and wraps add_param_group as torch
    does (its cache set by torch, not left at the bare function)."""
    import subprocess
    import sys

    code = """
import sys, torch
from effitrain.util.compat import dynamo_left_unimported
with dynamo_left_unimported():
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))], betas=(0.9, 0.99))
inside = "torch._dynamo" in sys.modules
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))])
function = torch.optim.Optimizer.add_param_group.__wrapped__
print(inside, "torch._dynamo" in sys.modules, getattr(function, "__dynamo_disable") is not function)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True", "True"]
