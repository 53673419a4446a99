"""The adapter group's checks (effitrain/config/adapter.py) beyond the table of bad inputs."""

from __future__ import annotations

import pytest
from transformers import utils

from effitrain.config.errors import ConfigError
from effitrain.config.validate import validate
from tests.helpers.run import compose


def test_qlora_is_refused_where_bitsandbytes_4bit_is_unavailable(monkeypatch):
    monkeypatch.setattr(utils, "is_bitsandbytes_available", lambda: False)
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
