"""Selective checkpointing (``gradient_checkpointing=N``: every N-th block recomputed): the same
arithmetic as none, so bit-identical losses and weights; its memory between none and all, measured
equal to predicted per category, on a classifier and a causal LM (4 blocks: 2 of them recomputed)."""

from __future__ import annotations

import pytest
import torch

from effitrain.config.summary_schema import CATEGORIES
from tests.helpers.run import compose, final_weights, read_metrics, run_job

BLOCKS = {
    "classifier": [],  # the tiny model's two blocks: the first recomputed with N=2, the second kept
    "causal": [
        "task=causal_lm",
        "model=llama_tiny",
        "max_length=64",
        "model.architecture.num_hidden_layers=4",
    ],
}
COMMON = [
    "micro_batch_size=16",
    "data.words_per_text=60",
    "data.num_train=64",
    "max_steps=3",
    "checkpoint_every=3",
]


def test_every_n_th_block_is_the_one_recomputed():
    from transformers import LlamaConfig, LlamaForCausalLM

    from effitrain.config.techniques import apply_techniques

    for value, flags in (("2", [True, False, True, False]), ("3", [True, False, False, True]),
                         ("true", [True] * 4), ("false", [False] * 4)):  # fmt: skip
        cfg = compose(*BLOCKS["causal"], f"gradient_checkpointing={value}")
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=4, num_attention_heads=2))  # fmt: skip
        apply_techniques(model, cfg)
        assert [layer.gradient_checkpointing for layer in model.model.layers] == flags, value


@pytest.mark.parametrize("kind", ["classifier", pytest.param("causal", marks=pytest.mark.slow)])
def test_selective_checkpointing_equals_none_bit_for_bit_and_is_predicted_to_the_byte(tmp_path, kind):
    values = ("false", "2") if kind == "classifier" else ("false", "2", "true")
    runs = {}
    for value in values:
        summary = run_job(tmp_path / value, *COMMON, *BLOCKS[kind], f"gradient_checkpointing={value}")
        assert summary["status"] == "ok", summary.get("error")
        runs[value] = summary
    plain, every_second = read_metrics(tmp_path / "false"), read_metrics(tmp_path / "2")
    assert [line["train/loss"] for line in every_second] == [line["train/loss"] for line in plain]
    assert runs["2"]["eval/loss"] == runs["false"]["eval/loss"]
    a, b = final_weights(tmp_path / "false"), final_weights(tmp_path / "2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # measured == predicted, category by category, to the byte
    measured = {c: runs["2"][f"mem/step_peak/{c}_bytes"] for c in CATEGORIES}
    assert measured == {c: runs["2"][f"mem/step_peak_predicted/{c}_bytes"] for c in CATEGORIES}
    if kind == "causal":  # activations set this peak: every second block's kept, between none and all
        activations = [runs[v]["mem/step_peak/activations_bytes"] for v in ("true", "2", "false")]
        assert activations[0] < activations[1] < activations[2]
