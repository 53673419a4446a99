"""Parameter groups and the schedule's length in optimizer steps."""

from __future__ import annotations

import math

import pytest
import torch

from effitrain.train.modeling import build_model, build_tokenizer
from effitrain.train.optim import build_optimizer, build_scheduler, num_optimizer_steps, param_groups
from tests.helpers.run import compose


def test_no_decay_group_holds_exactly_biases_and_norm_weights():
    cfg = compose()
    model = build_model(cfg.model, 3, build_tokenizer(cfg.model))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    expected_no_decay = {n for n in names.values() if n.endswith(".bias") or "LayerNorm" in n}
    assert no_decay_names == expected_no_decay
    assert decay_names == set(names.values()) - expected_no_decay
    # what decays: every weight matrix and the embeddings, nothing one-dimensional
    assert all(p.dim() == 2 for p in decay["params"])
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    # per layer 6 biases + 2 LayerNorms (weight, bias); embeddings LayerNorm; pooler and head biases
    assert len(no_decay_names) == 2 * (6 + 2 * 2) + 2 + 1 + 1


def test_tied_parameters_appear_once():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.norm = torch.nn.LayerNorm(4)
            self.out = torch.nn.Linear(4, 10)
            self.out.weight = self.embed.weight

    decay, no_decay = param_groups(Tied(), 0.01)
    assert len(decay["params"]) == 1  # the shared embedding/output matrix, once
    assert len(no_decay["params"]) == 3  # norm weight, norm bias, output bias


@pytest.mark.parametrize("batches, accumulation, epochs", [(13, 4, 2), (16, 4, 1), (7, 1, 3), (5, 8, 2)])
def test_step_count_is_after_accumulation(batches, accumulation, epochs):
    assert num_optimizer_steps(batches, accumulation, epochs) == math.ceil(batches / accumulation) * epochs
    assert num_optimizer_steps(batches, accumulation, epochs, max_steps=2) == 2


@pytest.mark.parametrize("name", ["linear", "cosine", "constant"])
def test_schedule_warms_up_for_ten_percent_and_spans_the_steps(name):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(compose(f"lr_scheduler={name}").lr_scheduler, optimizer, 20, warmup_ratio=0.1)
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:3] == [0.0, 0.5, 1.0]  # 2 warmup steps
    if name == "linear":
        assert lrs[-1] == pytest.approx(1 / 18)  # reaches 0 right after the last step
    elif name == "cosine":
        assert lrs[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 17 / 18)))
    else:
        assert lrs[2:] == [1.0] * 18


@pytest.mark.parametrize("steps, warmup", [(8, 1), (25, 3), (20, 2)])  # ceil(0.1 x steps): 0.8 -> 1, 2.5 -> 3
def test_warmup_rounds_up_a_fraction_of_a_step(steps, warmup):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = compose("lr_scheduler=constant").lr_scheduler
    scheduler = build_scheduler(schedule, optimizer, steps, warmup_ratio=0.1)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # transformers' constant schedule with warmup: step / warmup while warming up, then 1
    assert lrs == [step / warmup for step in range(warmup)] + [1.0] * (steps - warmup)


def test_apollo_resumes_from_a_weights_only_checkpoint_bit_identically():
    """APOLLO keeps a projector object per matrix; its checkpoint holds it as plain tensors and
    numbers, so it loads with weights_only=True and the next steps are the same."""
    import copy
    import io

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 40), torch.nn.Linear(40, 3))
    cfg = compose("optimizer=apollo", "optimizer.rank=8", "optimizer.update_proj_gap=2").optimizer
    optimizer = build_optimizer(cfg, model, 0.01)
    batch = torch.randn(4, 100)

    def steps(model, optimizer, n=3):
        for _ in range(n):
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    steps(model, optimizer)
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    saved.seek(0)
    resumed_model = copy.deepcopy(model)
    resumed = build_optimizer(cfg, resumed_model, 0.01)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    assert torch.equal(
        resumed.state[resumed_model[0].weight]["projector"].ortho_matrix,
        optimizer.state[model[0].weight]["projector"].ortho_matrix,
    )
    steps(model, optimizer)  # a new projection at step 4 (update_proj_gap=2), from the saved seed
    steps(resumed_model, resumed)
    for original, again in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(original, again)


@pytest.mark.slow
def test_apollo_default_scale_makes_its_step_on_minilm_matrices_the_size_of_adamws():
    """With scale 1 APOLLO's step on a matrix is sqrt(rank / side) of AdamW's (rank 32, MiniLM's
    side 384: 0.29x), which left the default task at the majority class; the default scale
    384 / 32 = 12 (the authors' fine-tuning rule, hidden size / rank) multiplies it by sqrt(12)."""

    def first_step(*overrides, shape=(384, 384)):
        torch.manual_seed(0)
        model = torch.nn.Linear(shape[1], shape[0], bias=False)
        start = model.weight.detach().clone()
        optimizer = build_optimizer(compose(*overrides).optimizer, model, 0.0)
        model.weight.grad = torch.randn(shape) * torch.rand(shape[0], 1)  # rows of unequal size
        optimizer.step()
        return (model.weight.detach() - start).norm().item()

    for shape in [(384, 384), (1536, 384), (384, 1536)]:  # attention, MLP in and out
        adamw = first_step("optimizer=adamw", shape=shape)
        apollo = first_step("optimizer=apollo", shape=shape)
        unscaled = first_step("optimizer=apollo", "optimizer.scale=1.0", shape=shape)
        assert compose("optimizer=apollo").optimizer.scale == 12.0
        assert apollo == pytest.approx(math.sqrt(12) * unscaled, rel=1e-5)
        assert unscaled / adamw == pytest.approx(math.sqrt(32 / 384), rel=0.05)
        assert apollo / adamw == pytest.approx(1.0, rel=0.05)


def test_a_parameter_named_like_a_bias_does_not_decay():
    # torch's own attention names its input projection's bias in_proj_bias: no decay, as any bias
    attention = torch.nn.MultiheadAttention(embed_dim=8, num_heads=2)
    decay, no_decay = param_groups(attention, weight_decay=0.1)
    names = {id(p): n for n, p in attention.named_parameters()}
    assert sorted(names[id(p)] for p in no_decay["params"]) == ["in_proj_bias", "out_proj.bias"]
    assert sorted(names[id(p)] for p in decay["params"]) == ["in_proj_weight", "out_proj.weight"]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
