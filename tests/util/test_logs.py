"""What effitrain keeps off a user's terminal: library warnings about the libraries' own calls."""

from __future__ import annotations

import warnings

import pytest
from transformers import BertConfig, BertForSequenceClassification


@pytest.mark.parametrize("quiet", [False, True])
def test_peft_s_read_of_a_deprecated_transformers_alias_is_not_shown(quiet):
    """peft's ``get_peft_model`` reads ``is_gradient_checkpointing``, which transformers deprecates
    with a FutureWarning per call: every adapter run, check and plan printed it. Shown without the
    filter (so the test can fail), gone with it; another FutureWarning still shows."""
    from peft import LoraConfig, get_peft_model

    from effitrain.util.logs import quiet_library_noise

    config = BertConfig(
        vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    with warnings.catch_warnings(record=True) as caught:  # the filters as they were, again on exit
        warnings.simplefilter("always")
        if quiet:
            quiet_library_noise()
        get_peft_model(BertForSequenceClassification(config), LoraConfig(target_modules=["query", "value"]))
        warnings.warn("another", FutureWarning, stacklevel=1)
    shown = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert sum("`is_gradient_checkpointing` is deprecated" in m for m in shown) == (0 if quiet else 1)
    assert "another" in shown
