"""A replay's peak found on two, three and four groups of blocks, moment by moment
(effitrain/memory/layer_memory.py, effitrain/memory/shared_traces.py): on timelines made by hand,
the whole model's peak, also where the largest moment moves from one stretch to another as blocks
are added; every mismatch refused; on models, every phase equal to the whole model's replay, byte
for byte, in every category."""

from __future__ import annotations

import pytest

import effitrain.memory.shared_traces
from effitrain.commands.estimate import meta_model, replay_shapes
from effitrain.memory.layer_memory import (
    GROUPS,
    MANY,
    WIDER,
    BothEndsOdd,
    NotExtrapolable,
    extrapolated,
    peak,
    worth_it,
)
from effitrain.memory.shared_traces import trace_runs
from tests.helpers.run import compose

DEVICE, HOST = "cuda:0", "cpu"


def moment(weights: int, activations: int, host: int = 0) -> dict:
    return {
        DEVICE: {"Parameter": weights, "Activation": activations, "Total": weights + activations},
        HOST: {"Temp": host, "Total": host},
    }


def timeline(groups: int, step: int = 7, logits: int = 40, head_per_block: int = 0, period: int = 1) -> list:
    """A step of ``groups`` groups of ``period`` blocks as a tracker would record it: weights of
    10 per block; each block's forward holds ``step`` more activations, in three moments of one more
    each; the logits' moment holds ``logits`` with every activation freed (the largest at few blocks);
    backward frees a block's activations and makes its gradient; a foreach over every gradient last.
    ``head_per_block``: a moment outside the blocks that grows with them."""
    blocks = groups * period
    weights = 10 * blocks
    moments = [((False, None), moment(weights, 0)), ((False, None), moment(weights, head_per_block * blocks))]
    for block in range(blocks):
        moments += [((False, block), moment(weights, step * block + k, host=block)) for k in range(3)]
    moments.append(((False, None), moment(weights, logits)))
    for block in reversed(range(blocks)):
        moments += [
            ((True, block), moment(weights, step * block + 2 * (blocks - 1 - block) + k)) for k in range(2)
        ]
    moments.append(((False, MANY), moment(weights, 2 * blocks)))
    return moments


def whole_peak(blocks: int, **kwargs) -> dict:
    """The peak MemTracker keeps on the whole timeline: each device's first moment at its highest."""
    return peak([m for _, m in timeline(blocks, **kwargs)])


def fewer(**kwargs) -> list:
    return [timeline(groups, **kwargs) for groups in GROUPS]


@pytest.mark.parametrize("blocks", [13, 20, 32, 80])
def test_the_whole_model_s_peak_from_three_smaller_timelines_where_the_largest_moment_moves(blocks):
    """At 2 to 4 blocks the logits' moment is the largest (40 against 7 * 3 + 2 = 23 at four); at 13
    blocks and more, the last block's forward (7 * 12 + 2 = 86): the extrapolation finds the whole
    model's peak, device by device, as its own timeline holds it."""
    assert peak([m for _, m in timeline(4)])[DEVICE]["Activation"] == 40
    assert whole_peak(blocks)[DEVICE]["Activation"] == 7 * (blocks - 1) + 2 > 40
    assert peak(extrapolated(fewer(), blocks, 1)) == whole_peak(blocks)
    assert peak(extrapolated(fewer(), blocks, 1))[HOST] == {"Temp": blocks - 1, "Total": blocks - 1}


def test_a_tie_keeps_the_first_moment_to_reach_it():
    """Blocks that all hold the same (no activation kept per block): the first block's moment is the
    first to reach the peak, with its own split of the bytes."""
    tied = fewer(step=0, logits=0)
    assert peak(extrapolated(tied, 20, 1)) == whole_peak(20, step=0, logits=0)


def test_groups_of_two_blocks():
    """Gradient checkpointing of every second block repeats every two blocks: groups of two, the
    replays at 4, 6 and 8 blocks."""
    periodic = [timeline(groups, period=2) for groups in GROUPS]
    assert peak(extrapolated(periodic, 26, 2)) == whole_peak(13, period=2)
    assert worth_it(20, 2) and not worth_it(18, 2) and not worth_it(21, 2) and not worth_it(9, 1)


def odd_end(moments: list, first: bool) -> list:
    """``moments`` with one more moment in the backward's first (or last) block: a gradient made
    outside its block's hooks, say."""
    blocks = [label[1] for label, _ in moments if label[0] and label[1] is not None]
    end = blocks[0] if first else blocks[-1]
    at = max(i for i, (label, _) in enumerate(moments) if label == (True, end))
    label, m = moments[at]
    return [*moments[: at + 1], (label, moment(m[DEVICE]["Parameter"], m[DEVICE]["Activation"] + 200)),
            *moments[at + 1 :]]  # fmt: skip


def test_a_stretch_with_one_odd_end():
    """A backward whose last block (the model's first) makes one moment more, 200 above the rest: the
    whole model's peak, from the odd end's own line; an odd moment at both ends refused at two to four
    groups, and the whole model's peak at three to five."""
    whole = [m for _, m in odd_end(timeline(20), first=False)]
    assert peak(extrapolated([odd_end(t, first=False) for t in fewer()], 20, 1)) == peak(whole)
    assert peak(whole)[DEVICE]["Activation"] == 7 * 0 + 2 * 19 + 1 + 200  # above the forward's 7 * 19 + 2
    both = [odd_end(odd_end(t, first=False), first=True) for t in fewer()]
    with pytest.raises(BothEndsOdd, match="both ends of a stretch are odd"):
        extrapolated(both, 20, 1)
    # both ends odd: one group more each (WIDER), the alike groups three, four and five... less two
    wider = [odd_end(odd_end(timeline(groups), first=False), first=True) for groups in WIDER]
    whole = [m for _, m in odd_end(odd_end(timeline(20), first=False), first=True)]
    assert peak(extrapolated(wider, 20, 1, WIDER)) == peak(whole)


def test_every_mismatch_is_refused():
    """A moment that grows as the square of the blocks, stretches that differ between the replays, a
    stretch that skips a block, and a block whose moments step unevenly: each refused."""
    squared = [
        [(label, moment(10 * g * g, m[DEVICE]["Activation"])) for label, m in timeline(g)] for g in GROUPS
    ]
    with pytest.raises(NotExtrapolable, match="not affine"):
        extrapolated(squared, 20, 1)
    other = fewer()
    other[1] = other[1][:-1]  # the four groups' replay lacks the foreach
    with pytest.raises(NotExtrapolable, match="stretches differ"):
        extrapolated(other, 20, 1)
    skipping = fewer()
    skipping[2] = [(label, m) for label, m in skipping[2] if label != (False, 3)]
    with pytest.raises(NotExtrapolable, match="every block once"):
        extrapolated(skipping, 20, 1)
    kinked = fewer()  # the three groups' second block holds one more than its line
    kinked[1] = [
        (label, moment(m[DEVICE]["Parameter"], m[DEVICE]["Activation"] + (label == (False, 1))))
        for label, m in kinked[1]
    ]
    with pytest.raises(NotExtrapolable, match="affine in its place"):
        extrapolated(kinked, 20, 1)


# --- on models: every phase of the shared trace equal to the whole model's replay -----------------

CASES = {
    "llama_bf16_cuda": (["task=causal_lm", "model=llama_small", "precision=bf16"], "cuda"),
    "llama_checkpointed_chunked": (
        ["task=causal_lm", "model=llama_small", "gradient_checkpointing=true", "loss_chunks=4"], "cpu"),
    "llama_offloaded_accumulated": (
        ["task=causal_lm", "model=llama_small", "precision=bf16", "activation_offloading=true",
         "gradient_accumulation_steps=3"], "cuda"),
    "llama_every_second_block": (["task=causal_lm", "model=llama_small", "gradient_checkpointing=2"], "cuda"),
    "bert_classifier": ([], "cpu"),
    # adapters: frozen weights (only the adapters' gradients clipped), DoRA's dead graph, a 4-bit base
    "llama_lora": (["task=causal_lm", "model=llama_small", "adapter=lora"], "cpu"),
    "bert_dora_checkpointed": (["adapter=dora", "gradient_checkpointing=true"], "cpu"),
    "llama_qlora_bf16_cuda": (["task=causal_lm", "model=llama_small", "adapter=qlora", "precision=bf16"], "cuda"),
}  # fmt: skip


def traced(overrides: list[str], device: str, layers: int) -> tuple[dict, dict]:
    cfg = compose(f"model.architecture.num_hidden_layers={layers}", "max_length=32", "micro_batch_size=2",
                  "eval_batch_size=3", *overrides)  # fmt: skip
    model = meta_model(cfg)
    batches, evaluation = replay_shapes(cfg, model)
    [trace] = trace_runs(model.config, {"adamw": cfg.optimizer}, cfg, batches, device, evaluation).values()
    return trace.phases, trace.bounds


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_phase_from_fewer_blocks_is_the_whole_model_s_to_the_byte(monkeypatch, case):
    """A 10-block model (20 with checkpointing of every second block, 14 with DoRA), its first step,
    later step and evaluation from replays of 2 to 4 groups (3 to 5 where both ends are odd), equal in every category (the host's offloaded copies
    too) to the whole model's replay."""
    overrides, device = CASES[case]
    # 20 blocks: ten groups of two; 14: DoRA's backward has both ends odd, replayed at three to five groups
    layers = 20 if "gradient_checkpointing=2" in overrides else 14 if "adapter=dora" in overrides else 10
    used = []
    by_groups = effitrain.memory.shared_traces.by_groups
    monkeypatch.setattr(effitrain.memory.shared_traces, "by_groups",
                        lambda *args: used.append(by_groups(*args)) or used[-1])  # fmt: skip
    found = traced(overrides, device, layers)
    assert used and used[0] is not None  # the smaller replays gave the figures
    monkeypatch.setattr(effitrain.memory.shared_traces, "by_groups", lambda *args: None)
    whole = traced(overrides, device, layers)
    assert found == whole
    phases, _ = whole
    assert phases["later_step"]["optimizer_state"] > 0 and phases["eval"]["activations"] > 0
    if "activation_offloading=true" in overrides:
        assert phases["first_step"]["host_offloaded"] > 0


def test_the_whole_model_s_gradients_take_the_layouts_of_their_place_in_a_group():
    """Gradients made for the whole model (ByGroups.backward) take the layout the smaller replay left
    at the same place in a group of ``period`` blocks: here every second block's gradient is
    transposed, so block 5 of 6 must be laid out as block 1 of 4 is, block 4 as block 0; a gradient
    sharing another's storage, or starting inside its storage, is refused (None)."""
    import torch

    from effitrain.memory.shared_backward import ByGroups, _layouts

    def model(blocks: int):
        net = torch.nn.Module()
        net.embed = torch.nn.Linear(3, 4)
        net.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(blocks))
        return net

    def gradients(net):  # every odd block's weight gradient transposed (column-major)
        grads = []
        for name, param in net.named_parameters():
            odd = name.startswith("blocks.") and int(name.split(".")[1]) % 2
            grads.append(torch.zeros(4, 4).t() if odd else torch.zeros_like(param))
        return grads

    small = model(4)
    layouts = _layouts(small, gradients(small), "blocks", 2)
    assert layouts[(1, "weight")][1] == (1, 4) and layouts[(0, "weight")][1] == (4, 1)
    whole = model(6)
    ByGroups({}, {}, None, layouts, "blocks", 2).backward(whole)
    assert [block.weight.grad.stride() for block in whole.blocks] == [(4, 1), (1, 4)] * 3
    assert whole.embed.weight.grad.shape == (4, 3) and whole.embed.bias.grad.shape == (4,)
    shared = gradients(small)
    shared[-1] = shared[-3]  # the last block's gradient on the second-to-last's storage
    assert _layouts(small, shared, "blocks", 2) is None
    inside = gradients(small)
    inside[1] = torch.zeros(5)[1:]  # the embedding's bias from its storage's second element
    assert _layouts(small, inside, "blocks", 2) is None
    assert _layouts(small, gradients(small), "blocks", 1) is None  # blocks 0 and 1 laid out apart
