"""The backend contract: each backend of the config group keeps it, and one step's operations
reach ``window_step`` as one ``StepOps``."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from effitrain.backends.base import Backend, backend_of
from effitrain.config.errors import ConfigError
from effitrain.config.registry import group_options
from effitrain.train.step import StepOps, window_step
from tests.helpers.run import compose


@pytest.mark.parametrize("option", group_options("backend"))
def test_every_backend_keeps_the_contract(option):
    node = compose(f"backend={option}").backend
    fit = instantiate(node)
    backend = backend_of(node)
    assert isinstance(backend, Backend)
    assert backend.__name__ == f"effitrain.backends.{option}" and backend.fit is fit.func
    # only the Trainer loads its own checkpoint (its resume_from_checkpoint)
    assert backend.loads_checkpoint is (option == "trainer")


@pytest.mark.parametrize("target", ["effitrain.train.step.step_loss", "effitrain.nowhere.fit"])
def test_a_target_that_is_no_backend_is_named(target):
    with pytest.raises(
        ConfigError, match=rf"^backend\._target_='{target}' is invalid: a backend is a module"
    ):
        backend_of(OmegaConf.create({"_target_": target, "_partial_": True}))


class _SquaredSum:
    """A task whose loss is the summed square of a linear model's output."""

    def loss_sum(self, model, batch):
        return (model(batch["x"]) ** 2).sum()


class _Meter:
    def __init__(self):
        self.losses = []

    def add(self, loss, batch):
        self.losses.append(loss.item())


def test_window_step_uses_the_step_ops_in_order():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradient stays readable
    window = [{"x": torch.randn(2, 3)}, {"x": torch.randn(3, 3)}]
    events, backward_losses = [], []

    @contextlib.contextmanager
    def no_sync():
        events.append("no_sync")
        yield

    def backward(loss):
        events.append("backward")
        backward_losses.append(loss.item())
        loss.backward()

    def clip():
        events.append("clip")
        return torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))

    expected_grad = (
        sum(torch.autograd.grad((model(b["x"]) ** 2).sum(), model.weight)[0] for b in window) * 2 / 5
    )
    meter = _Meter()
    optimizer.zero_grad = lambda set_to_none=True: events.append("zero_grad")  # keep .grad to read it
    norm = window_step(_SquaredSum(), model, optimizer, window, 5, meter, StepOps(backward, no_sync, clip, 2))
    # no_sync around every micro-batch but the last; clip once, after all backward passes
    assert events == ["no_sync", "backward", "backward", "clip", "zero_grad"]
    # each micro-batch's summed loss x processes / the step's items
    assert backward_losses == pytest.approx([loss * 2 / 5 for loss in meter.losses], rel=1e-6)
    torch.testing.assert_close(model.weight.grad, expected_grad)
    assert norm.item() == pytest.approx(expected_grad.norm().item(), rel=1e-6)


def test_the_trainer_s_loss_is_its_share_of_the_step_over_every_process():
    """DDP averages the processes' gradients, so each process's loss is its summed micro-batch loss
    over the whole step's items, times the processes: 6 / 8 x 2 = 1.5 on 2 processes (a Trainer that
    passed 1 would step every run of 2 processes at half its gradient; the torchrun tests catch it in
    a run, slowly). compute_loss alone, on a Trainer never set up."""
    from types import SimpleNamespace

    from effitrain.backends.trainer import _EffitrainTrainer

    seen, added = [], []
    trainer = object.__new__(_EffitrainTrainer)
    trainer._job = SimpleNamespace(
        step_memory=SimpleNamespace(saw=seen.append),
        task=SimpleNamespace(loss_sum=lambda model, inputs: torch.tensor(6.0)),
        meter=SimpleNamespace(add=lambda loss, inputs: added.append(loss.item())),
    )
    trainer.accelerator = SimpleNamespace(num_processes=2)
    inputs = {"input_ids": torch.zeros(2, 3)}
    assert trainer.compute_loss(None, inputs, num_items_in_batch=8).item() == 1.5
    assert seen == [inputs] and added == [6.0]  # the tracker saw the batch, the meter its summed loss
