"""The optimizer step in backward's technique (effitrain.config.techniques.in_backward): its refusals,
its plan axis and replay key, and its hooks on a plain model against a plain loop."""

from __future__ import annotations

import pytest
import torch

from effitrain.config.errors import ConfigError
from effitrain.config.techniques import OPTIMIZER_IN_BACKWARD, TECHNIQUES, check_techniques, replay_keys
from tests.helpers.run import compose

ON = ["optimizer_in_backward=true", "max_grad_norm=0"]


def test_it_is_a_technique_with_its_key_its_replay_entry_and_its_override():
    assert OPTIMIZER_IN_BACKWARD in TECHNIQUES
    assert compose().optimizer_in_backward is False  # conf/config.yaml's default: off
    assert replay_keys(compose(*ON))["optimizer_in_backward"] is True
    assert replay_keys(compose())["optimizer_in_backward"] is False
    assert OPTIMIZER_IN_BACKWARD.override(True) == "optimizer_in_backward=true"
    assert OPTIMIZER_IN_BACKWARD.described(compose()) == "optimizer_in_backward=false"


def test_the_trace_cache_keys_a_run_with_it_apart_from_one_without():
    from transformers import BertConfig

    from effitrain.memory.trace_cache import trace_key

    cfg_on, cfg_off = compose(*ON), compose("max_grad_norm=0")
    keys = [trace_key(BertConfig(), cfg.optimizer, cfg, [], None, "cpu") for cfg in (cfg_on, cfg_off)]
    assert keys[0] != keys[1]
    assert {k: v for k, v in keys[0].items() if k != "optimizer_in_backward"} == {
        k: v for k, v in keys[1].items() if k != "optimizer_in_backward"
    }


@pytest.mark.parametrize(
    "overrides, start",
    [
        (
            ["max_grad_norm=0.5"],
            "max_grad_norm=0.5 is invalid: with optimizer_in_backward=true each gradient",
        ),
        (
            ["gradient_accumulation_steps=3"],
            "gradient_accumulation_steps=3 is invalid: with optimizer_in_backward",
        ),
        (["backend=trainer"], "backend='trainer' is invalid: with optimizer_in_backward=true: the Trainer"),
        (["parallel=fsdp"], "parallel='fsdp' is invalid: with optimizer_in_backward=true: FSDP reduces"),
        (
            ["precision=fp16"],
            "precision='fp16' is invalid: with optimizer_in_backward=true: fp16's grad scaler",
        ),
        (["compile=on"], "compile='on' is invalid: with optimizer_in_backward=true a compiled model"),
        (
            ["optimizer=adamw4bit"],
            "optimizer='adamw4bit' is invalid: with optimizer_in_backward=true: its update",
        ),
    ],
)
def test_each_setting_it_cannot_run_with_is_one_line_naming_the_key_and_what_is_allowed(overrides, start):
    # straight to the technique's check: fp16 without CUDA and torchao when not installed are refused
    # earlier by validate, so the bad-inputs table cannot reach these lines on every machine
    cfg = compose(*ON, *overrides)
    with pytest.raises(ConfigError) as refused:
        check_techniques(cfg)
    message = str(refused.value)
    assert message.startswith(start) and "\n" not in message
    assert OPTIMIZER_IN_BACKWARD.plan_values(cfg, False) == [False]  # plan never tries it there


def test_more_than_one_process_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^parallel='ddp' is invalid: .* \(2 processes\); launch one$"):
        check_techniques(compose(*ON))


def test_every_optimizer_but_torchao_and_the_bf16_autocast_are_taken():
    for option in ("adamw", "adamw_fused", "adafactor", "adam8bit", "lion", "apollo"):
        check_techniques(compose(*ON, f"optimizer={option}"))
    check_techniques(compose(*ON, "precision=bf16"))
    check_techniques(compose(*ON, "adapter=lora"))


def test_its_plan_axis_is_off_then_on_the_users_own_alone_or_off_alone_where_clipping_is_on():
    runnable = compose("max_grad_norm=0")
    assert OPTIMIZER_IN_BACKWARD.plan_values(runnable, False) == [False, True]
    assert OPTIMIZER_IN_BACKWARD.plan_values(runnable, False, (True, False)) == [False, True]
    assert OPTIMIZER_IN_BACKWARD.plan_values(compose(*ON), True) == [True]
    assert OPTIMIZER_IN_BACKWARD.plan_values(runnable, True) == [False]
    assert OPTIMIZER_IN_BACKWARD.plan_values(compose(), False) == [False]  # the default clips at 1.0


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def test_hooks_update_each_parameter_as_a_plain_loop_does_and_free_every_gradient():
    from effitrain.config.techniques.in_backward_hooks import InBackward

    inputs = torch.randn(4, 6)
    plain, hooked = _mlp(), _mlp()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (plain, hooked)]
    hooks = InBackward(hooked, optimizers[1])
    for _ in range(3):
        plain(inputs).square().sum().backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf"))
        optimizers[0].step()
        optimizers[0].zero_grad()
        hooked(inputs).square().sum().backward()
        assert all(p.grad is None for p in hooked.parameters())  # each freed in its hook
        assert torch.equal(hooks.norm(), expected_norm)
        optimizers[1].step()  # the backend's own step after backward: no gradient, no change
        for a, b in zip(plain.parameters(), hooked.parameters()):
            assert torch.equal(a, b)
    # one state per parameter, as the step after backward keeps it
    assert [optimizers[1].state[p]["step"].item() for p in hooked.parameters()] == [3.0] * 4
    hooks.remove()
    hooked(inputs).sum().backward()
    assert all(p.grad is not None for p in hooked.parameters())  # removed: gradients stay again


def test_a_gradient_hook_registered_after_it_still_sees_the_gradient_before_the_update():
    from effitrain.config.techniques.in_backward_hooks import InBackward

    model = _mlp()
    # held, as a run's job holds it: autograd keeps the accumulator nodes (and their hooks) weakly
    hooks = InBackward(model, torch.optim.SGD(model.parameters(), lr=1.0))
    seen = []

    def later(param):  # as the memory trackers' hooks, registered once the run is under way
        seen.append((param.grad is not None, param.detach().clone()))

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(later)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 6)).sum().backward()
    assert len(seen) == 4 and all(had_grad for had_grad, _ in seen)
    # it saw the weights before the update; the update then moved them
    by_shape = {tuple(b.shape): b for b in before}
    assert all(torch.equal(weight, by_shape[tuple(weight.shape)]) for _, weight in seen)
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    hooks.remove()
