"""The memory techniques' home (effitrain.config.techniques): gradient checkpointing's check, what it
applies to a model, its replay key and its plan axis, each asked of the technique."""

from __future__ import annotations

import pytest

from effitrain.config.errors import ConfigError
from effitrain.config.techniques import (
    GRADIENT_CHECKPOINTING,
    TECHNIQUES,
    apply_techniques,
    check_techniques,
    described,
    replay_keys,
)
from tests.helpers.run import compose

MPNET = ["model.architecture.model_type=mpnet"]  # a model class without gradient checkpointing


def test_gradient_checkpointing_is_the_first_technique_and_says_its_key_values_and_override():
    assert [t.key for t in TECHNIQUES] == [
        "gradient_checkpointing", "activation_offloading", "loss_chunks", "optimizer_in_backward"
    ]  # fmt: skip
    on, off = compose("gradient_checkpointing=true"), compose()
    # offloading off: no entry (the keys of traces cached before it stay theirs)
    assert replay_keys(on) == {
        "gradient_checkpointing": True,
        "loss_chunks": 1,
        "optimizer_in_backward": False,
    }
    assert replay_keys(off) == {
        "gradient_checkpointing": False,
        "loss_chunks": 1,
        "optimizer_in_backward": False,
    }
    assert (described(on), described(off)) == ("gradient_checkpointing=true", "gradient_checkpointing=false")
    levers = compose("task=causal_lm", "model=llama_tiny", "loss_chunks=4", "activation_offloading=2048")
    assert described(levers) == "gradient_checkpointing=false, activation_offloading=2048, loss_chunks=4"
    assert GRADIENT_CHECKPOINTING.override(True) == "gradient_checkpointing=true"


def test_its_plan_axis_is_off_then_on_the_users_own_alone_or_off_alone_where_the_model_cannot():
    assert GRADIENT_CHECKPOINTING.plan_values(compose(), False, (True, False)) == [False, True]
    assert GRADIENT_CHECKPOINTING.plan_values(compose("gradient_checkpointing=true"), True) == [True]
    assert GRADIENT_CHECKPOINTING.plan_values(compose(), True) == [False]
    assert GRADIENT_CHECKPOINTING.plan_values(compose(*MPNET), False) == [False]


def test_its_check_names_the_key_the_value_and_the_model_class_that_cannot_recompute():
    check_techniques(compose("gradient_checkpointing=true"))  # BERT can
    check_techniques(compose(*MPNET))  # off: nothing to check
    with pytest.raises(ConfigError) as refused:
        check_techniques(compose(*MPNET, "gradient_checkpointing=true"))
    assert str(refused.value) == (
        "gradient_checkpointing=true is invalid: MPNetForSequenceClassification cannot recompute "
        "activations: give false"
    )


def test_applied_to_a_model_it_checkpoints_every_layer_and_switches_the_cache_off():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2, use_cache=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    apply_techniques(model, compose())  # off: the model is left as it was
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [False] * 3
    assert model.config.use_cache
    apply_techniques(model, compose("gradient_checkpointing=true"))
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True] * 3
    assert not model.config.use_cache


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "0",
            "gradient_checkpointing=0 is invalid: must be true, false or N >= 1 (recompute every N-th block)",
        ),
        (
            "-2",
            "gradient_checkpointing=-2 is invalid: must be true, false or N >= 1 (recompute every N-th block)",
        ),
    ],
)
def test_a_selective_interval_below_one_is_one_line(value, message):
    from effitrain.config.errors import ConfigError

    with pytest.raises(ConfigError) as raised:
        check_techniques(compose(f"gradient_checkpointing={value}"))
    assert str(raised.value) == message


def test_selective_checkpointing_has_its_own_replay_key_and_override():
    every_second = compose("gradient_checkpointing=2")
    assert replay_keys(every_second)["gradient_checkpointing"] == 2
    assert replay_keys(compose("gradient_checkpointing=1")) == replay_keys(
        compose("gradient_checkpointing=true")
    )
    assert described(every_second).split(", ")[0] == "gradient_checkpointing=2"
    assert GRADIENT_CHECKPOINTING.override(3) == "gradient_checkpointing=3"
