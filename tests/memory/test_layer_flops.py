"""A step's FLOPs counted on one, two and three groups of blocks and extrapolated
(effitrain/memory/layer_flops.py): equal to a hand count and to the whole model's count, and the
whole model counted wherever the extrapolation would not be exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import effitrain.memory.replay
from effitrain.commands.estimate import estimate_memory
from effitrain.memory.layer_flops import counted_by_groups
from tests.helpers.run import compose


def bert_forward(layers: int, rows: int = 8, seq: int = 8, hidden: int = 32, heads: int = 2, inner: int = 64,
                 labels: int = 3) -> tuple[int, int]:  # fmt: skip
    """The tiny BERT's forward FLOPs by hand: (one block's, the whole model's); 2 per multiply-add."""
    tokens = rows * seq
    per_layer = (
        4 * 2 * tokens * hidden * hidden  # query, key, value, output projections
        + 2 * 2 * tokens * hidden * inner  # feed-forward in and out
        + 2 * 2 * rows * heads * seq * seq * (hidden // heads)  # scores and the weighted sum
    )
    return per_layer, layers * per_layer + 2 * rows * hidden * hidden + 2 * rows * hidden * labels


def estimated(*overrides: str, device: str = "cpu") -> dict:
    cfg = compose("max_length=8", "micro_batch_size=8", *overrides)
    [row] = estimate_memory(cfg, {"adamw": cfg.optimizer}, device=device, share=False).values()
    return row


@pytest.mark.slow  # the fast selection's: the fall-backs and the extrapolation below, on counts given
@pytest.mark.parametrize(
    "checkpointing, recomputed_blocks",
    [("false", 0), ("2", 7), ("true", 14)],
)
def test_a_fourteen_block_model_s_flops_from_three_smaller_counts_equal_a_hand_count(
    monkeypatch, checkpointing, recomputed_blocks
):
    """The tiny BERT with 14 blocks, rows of 8 tokens, 8 rows: forward and backward (twice the forward)
    by hand; with checkpointing, each recomputed block's forward once more. Only models of 1 to 6
    blocks are built to count (6: three groups of two, checkpointing every second block)."""
    counted_blocks = []
    original = effitrain.memory.replay.counted_by_groups

    def watched(config, count_with, whole, period=1, model=None):
        def counting(smaller):
            counted_blocks.append(smaller.num_hidden_layers)
            return count_with(smaller)

        assert model is not None  # its blocks are checked alike
        return original(config, counting, lambda: pytest.fail("the whole model was counted"), period, model)

    monkeypatch.setattr(effitrain.memory.replay, "counted_by_groups", watched)
    row = estimated("model.architecture.num_hidden_layers=14", f"gradient_checkpointing={checkpointing}")
    per_layer, forward = bert_forward(layers=14)
    assert row["flops_per_step"] == 3 * forward == 46_846_464
    assert row["recomputed_flops_per_step"] == recomputed_blocks * per_layer
    period = {"false": 1, "2": 2, "true": 1}[checkpointing]
    model_counts = [1, 2, 3]
    assert counted_blocks == model_counts + ([period, 2 * period, 3 * period] if recomputed_blocks else [])


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, device",
    [
        (["task=causal_lm", "gradient_checkpointing=true", "loss_chunks=2"], "cpu"),
        (["task=causal_lm", "precision=bf16", "gradient_checkpointing=true"], "cuda"),
        (["adapter=lora", "gradient_checkpointing=2"], "cpu"),
    ],
    ids=["causal_chunked_loss", "causal_bf16_cuda", "lora"],
)
def test_extrapolated_counts_equal_the_whole_model_s(monkeypatch, overrides, device):
    """A causal Llama (chunked loss, CUDA's kernels in bf16) and a LoRA classifier, 14 blocks: the
    model FLOPs and the recomputed ones equal the counts of the whole model."""
    overrides = ["model.architecture.num_hidden_layers=14", *overrides]
    extrapolated = estimated(*overrides, device=device)
    monkeypatch.setattr(effitrain.memory.replay, "counted_by_groups",
                        lambda config, count_with, whole, period=1, model=None: whole())  # fmt: skip
    whole = estimated(*overrides, device=device)
    keys = ("flops_per_step", "recomputed_flops_per_step")
    assert [extrapolated[k] for k in keys] == [whole[k] for k in keys]
    assert whole["flops_per_step"] > 0 and whole["recomputed_flops_per_step"] > 0


def test_the_whole_model_is_counted_where_an_extrapolation_would_not_be_exact_or_not_cheaper():
    """Blocks of two kinds, blocks not in whole groups, counts that do not lie on a line, and a model
    of six groups or fewer (the three counts would build as many blocks): each counted whole; blocks
    alike: outside + blocks * per block."""
    def affine(config):
        return 100 + 7 * config.num_hidden_layers

    def whole():
        return "whole"

    config = SimpleNamespace(num_hidden_layers=8, layer_types=["full"] * 8)
    assert counted_by_groups(config, affine, whole) == 100 + 7 * 8
    assert counted_by_groups(SimpleNamespace(num_hidden_layers=14), affine, whole, period=2) == 100 + 7 * 14
    assert config.num_hidden_layers == 8 and config.layer_types == ["full"] * 8  # the caller's untouched
    mixed = SimpleNamespace(num_hidden_layers=8, layer_types=["sliding", "full"] * 4)
    assert counted_by_groups(mixed, affine, whole) == "whole"
    assert counted_by_groups(SimpleNamespace(num_hidden_layers=6), affine, whole) == "whole"
    assert counted_by_groups(SimpleNamespace(num_hidden_layers=7), affine, whole) == 100 + 7 * 7
    assert counted_by_groups(SimpleNamespace(num_hidden_layers=12), affine, whole, period=2) == "whole"
    assert counted_by_groups(SimpleNamespace(num_hidden_layers=15), affine, whole, period=2) == "whole"
    quadratic = lambda config: config.num_hidden_layers**2  # noqa: E731
    assert counted_by_groups(SimpleNamespace(num_hidden_layers=8), quadratic, whole) == "whole"
    seen = []
    counted_by_groups(config, lambda c: seen.append((c.num_hidden_layers, len(c.layer_types))) or 0, whole)
    assert seen == [(1, 1), (2, 2), (3, 3)]


def test_a_model_whose_blocks_are_not_built_alike_is_counted_whole():
    """The first blocks dense, the rest mixtures of experts (as DeepSeek's first_k_dense_replace
    builds them): one, two and three blocks would all be dense and lie on a line, so the check is
    of the whole model's blocks as built. Alike blocks, in one list or in two (an encoder's and a
    decoder's), are extrapolated."""
    import torch

    class Dense(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(4, 4)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def model_of(*lists):
        model = torch.nn.Module()
        for index, blocks in enumerate(lists):
            model.add_module(f"blocks{index}", torch.nn.ModuleList(blocks))
        return model

    def affine(config):
        return 100 + 7 * config.num_hidden_layers

    config = SimpleNamespace(num_hidden_layers=8)
    first_dense = model_of([Dense() for _ in range(3)] + [Experts() for _ in range(5)])
    assert counted_by_groups(config, affine, lambda: "whole", model=first_dense) == "whole"
    assert counted_by_groups(config, affine, lambda: "whole", model=model_of([Dense() for _ in range(8)])) == 156
    two_lists = model_of([Dense() for _ in range(8)], [Experts() for _ in range(8)])
    assert counted_by_groups(config, affine, lambda: "whole", model=two_lists) == 156
    wider = model_of([Dense() for _ in range(7)] + [Dense()])
    wider.blocks0[7].mlp = torch.nn.Linear(4, 8)  # the same classes, another shape
    assert counted_by_groups(config, affine, lambda: "whole", model=wider) == "whole"
    assert counted_by_groups(config, affine, lambda: "whole", model=model_of([Dense()] * 4)) == "whole"
