"""Proven equivalences: a knob changes what it claims to change and nothing else.

fp32, CPU, tiny model, dropout off, fixed seed.
"""

from __future__ import annotations

import pytest
import torch

from effitrain.train.modeling import build_model
from tests.helpers.run import fit_with_snapshots

NO_DROPOUT = [
    "+model.config_overrides.hidden_dropout_prob=0.0",
    "+model.config_overrides.attention_probs_dropout_prob=0.0",
]
# 58 samples: with an effective batch of 16 the last optimizer step of each epoch holds 10 samples,
# so accumulation 4 x 4 ends on a window of micro-batches of 4, 4 and 2 samples.
SMALL = ["data.num_train=58", "data.num_eval=24", "epochs=2", "optimizer.lr=1e-3", *NO_DROPOUT]


def _zero_gradient(name: str) -> bool:
    """The attention key bias adds the same score q.b to every key, which softmax cancels: its
    gradient is exactly zero in exact arithmetic, so what it receives is rounding noise that
    Adam-style optimizers normalize to steps of about lr. It carries no signal to compare."""
    return name.endswith("attention.self.key.bias")


def relative_difference(a: dict, b: dict) -> float:
    """||a - b|| / ||a|| over all parameters taken as one vector."""
    names = [name for name in a if not _zero_gradient(name)]
    flat_a = torch.cat([a[name].flatten().double() for name in names])
    flat_b = torch.cat([b[name].flatten().double() for name in names])
    return ((flat_a - flat_b).norm() / flat_a.norm()).item()


def assert_same_training(a, b, param_rtol: float, loss_rtol: float):
    assert [line["step"] for line in a.lines] == [line["step"] for line in b.lines]
    for line_a, line_b, params_a, params_b in zip(a.lines, b.lines, a.params, b.params, strict=True):
        assert line_a["train/samples"] == line_b["train/samples"]
        assert line_a["lr"] == pytest.approx(line_b["lr"], rel=1e-12)
        assert line_a["train/loss"] == pytest.approx(line_b["train/loss"], rel=loss_rtol)
        # Adam-style updates hardly change when the gradient is scaled: the norm shows a scale error.
        assert line_a["grad_norm"] == pytest.approx(line_b["grad_norm"], rel=loss_rtol)
        assert relative_difference(params_a, params_b) < param_rtol, f"step {line_a['step']}"


@pytest.mark.parametrize("backend", ["accelerator", pytest.param("trainer", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "optimizer", ["adamw", *(pytest.param(o, marks=pytest.mark.slow) for o in ("adafactor", "adam8bit"))]
)
def test_accumulation_equals_the_big_batch(tmp_path, backend, optimizer):
    common = [f"backend={backend}", f"optimizer={optimizer}", *SMALL]
    big, _, _ = fit_with_snapshots(
        tmp_path / "big", "micro_batch_size=16", "gradient_accumulation_steps=1", *common
    )
    accumulated, _, _ = fit_with_snapshots(
        tmp_path / "acc", "micro_batch_size=4", "gradient_accumulation_steps=4", *common
    )
    assert [line["train/samples"] for line in big.lines] == [16, 32, 48, 58, 74, 90, 106, 116]
    assert_same_training(big, accumulated, param_rtol=1e-6, loss_rtol=1e-6)


@pytest.mark.parametrize(
    "optimizer", ["adamw", *(pytest.param(o, marks=pytest.mark.slow) for o in ("adafactor", "adam8bit"))]
)
def test_backends_compute_the_same_thing(tmp_path, optimizer):
    common = [f"optimizer={optimizer}", "micro_batch_size=4", "gradient_accumulation_steps=3", *SMALL]
    accel, accel_metrics, _ = fit_with_snapshots(tmp_path / "a", "backend=accelerator", *common)
    trainer, trainer_metrics, _ = fit_with_snapshots(tmp_path / "t", "backend=trainer", *common)
    assert_same_training(accel, trainer, param_rtol=1e-6, loss_rtol=1e-5)
    for key in ("eval/loss", "eval/accuracy", "eval/f1"):
        assert accel_metrics[key] == pytest.approx(trainer_metrics[key], rel=1e-5)


@pytest.mark.slow
def test_backends_see_the_same_batches_in_the_same_order(tmp_path):
    seen = {}
    for backend in ("accelerator", "trainer"):
        snapshots, _, job = fit_with_snapshots(
            tmp_path / backend, f"backend={backend}", "max_steps=5", *SMALL
        )
        seen[backend] = [line["train/tokens"] for line in snapshots.lines]
        # the sampler is effitrain's, and its order is a pure function of seed and epoch
        sampler = job.train_loader.sampler
        sampler.set_epoch(1)
        assert (
            list(sampler)[:5] == torch.randperm(58, generator=torch.Generator().manual_seed(43)).tolist()[:5]
        )
    assert seen["accelerator"] == seen["trainer"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_compile_changes_speed_not_the_numbers(tmp_path, backend):
    common = [f"backend={backend}", "max_steps=6", "micro_batch_size=8", *SMALL]
    eager, _, _ = fit_with_snapshots(tmp_path / "eager", "compile=off", *common)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled, _, job = fit_with_snapshots(tmp_path / "compiled", "compile=on", *common)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before  # really compiled
    eager_losses = [line["train/loss"] for line in eager.lines]
    compiled_losses = [line["train/loss"] for line in compiled.lines]
    assert compiled_losses[0] == pytest.approx(eager_losses[0], abs=1e-4)
    # Inductor fuses and reorders float operations; over 6 steps the curves stay within 1e-3.
    assert compiled_losses == pytest.approx(eager_losses, abs=1e-3)

    # What is saved comes from the uncompiled module and loads into a plain model, key for key.
    state = job.model.state_dict()
    torch.testing.assert_close(dict(job.model.named_parameters()), compiled.params[-1], rtol=0, atol=0)
    assert not [key for key in state if "_orig_mod" in key]
    fresh = build_model(job.cfg.model, 3, job.tokenizer)
    result = fresh.load_state_dict(state, strict=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
