"""The adapter group's checks (effitrain/config/adapter.py) beyond the table of bad inputs."""

from __future__ import annotations

import pytest

from effitrain.config import adapter as adapter_checks
from effitrain.config.errors import ConfigError
from effitrain.config.validate import validate
from tests.helpers.run import compose


def test_qlora_is_refused_where_bitsandbytes_4bit_is_unavailable(monkeypatch):
    # effitrain's name for it: transformers' modules bind its function when first imported
    monkeypatch.setattr(adapter_checks, "bitsandbytes_4bit_available", lambda: False)
    with pytest.raises(ConfigError) as error:
        validate(compose("adapter=qlora"))
    assert str(error.value) == (
        "adapter='qlora' is invalid: needs bitsandbytes' 4-bit layers, unavailable here: install "
        "bitsandbytes, or use adapter=lora"
    )
    validate(compose("adapter=lora"))  # LoRA alone needs no 4-bit layers


@pytest.mark.parametrize("adapter", ["none", "lora", "dora", "qlora"])
def test_every_adapter_passes_on_both_tasks(adapter):
    validate(compose(f"adapter={adapter}"))
    validate(compose(f"adapter={adapter}", "task=causal_lm", "model=llama_tiny"))


def test_a_decoder_is_named_by_its_own_modules():
    with pytest.raises(ConfigError, match="such as down_proj, gate_proj, k_proj, lm_head, o_proj"):
        validate(
            compose("adapter=lora", "adapter.target_modules=[query]", "task=causal_lm", "model=llama_tiny")
        )


def test_a_head_with_a_pre_classifier_trains_in_full_without_lora_on_it():
    # peft trains modules whose names end in classifier in full; LoRA on one of them too cannot be wrapped
    from peft import get_peft_model
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from effitrain.config.adapter import lora_config
    from effitrain.train.tasks import Classification

    config = DistilBertConfig(vocab_size=100, dim=32, hidden_dim=64, n_layers=1, n_heads=2, num_labels=3)
    model = DistilBertForSequenceClassification(config)
    wrapped = get_peft_model(model, lora_config(compose("adapter=lora").adapter, Classification, model))
    trained = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    head = {n for n in trained if "classifier" in n}
    assert head == {f"base_model.model.{m}.modules_to_save.default.{w}" for m in ("pre_classifier", "classifier")
                    for w in ("weight", "bias")}  # fmt: skip
    assert sum(".lora_A." in n for n in trained) == 6  # q, k, v, out, two FFN Linear layers of the one block
