"""The private APIs of transformers, accelerate, datasets and peft in effitrain/util/compat/huggingface.py,
each against the installed release."""

from __future__ import annotations

import torch

from effitrain.util import compat


def test_transformers_mask_skipping_deciders_say_skip_for_an_unpadded_batch():
    """True means "build no mask": for no padding mask at all, and not for a padded batch."""
    from transformers import masking_utils

    causal = masking_utils._ignore_causal_mask_sdpa
    bidirectional = masking_utils._ignore_bidirectional_mask_sdpa
    padded = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    assert causal(padding_mask=None, q_length=4, kv_length=4, q_offset=0, kv_offset=0) is True
    assert causal(padding_mask=padded, q_length=4, kv_length=4, q_offset=0, kv_offset=0) is False
    assert bidirectional(padding_mask=None, kv_length=4) is True
    assert bidirectional(padding_mask=padded, kv_length=4) is False
    calls = []

    def follow(original):
        def decide(*args, **kwargs):
            calls.append(original.__name__)
            return original(*args, **kwargs)

        return decide

    with compat.mask_skipping_replaced(follow):
        assert masking_utils._ignore_bidirectional_mask_sdpa(padding_mask=None, kv_length=4) is True
        assert masking_utils._ignore_causal_mask_sdpa(None, 4, 4, 0, 0) is True
    assert calls == ["_ignore_bidirectional_mask_sdpa", "_ignore_causal_mask_sdpa"]
    assert masking_utils._ignore_causal_mask_sdpa is causal  # restored
    assert masking_utils._ignore_bidirectional_mask_sdpa is bidirectional


def test_transformers_checkpointing_function_is_what_recomputation_calls():
    """Every checkpointed layer of a model calls its _gradient_checkpointing_func with the function
    it recomputes: wrapping it sees the forward once and the recomputation once per layer."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    calls = []

    def wrap(fn):
        def counted(*args, **kwargs):
            calls.append(torch.is_grad_enabled())
            return fn(*args, **kwargs)

        return counted

    assert compat.checkpointing_wrapped(model, wrap) == 2
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 4  # two layers: each forward, then each recomputation in backward


def test_attention_implementation_is_what_the_model_runs():
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    for chosen in ("eager", "sdpa"):
        config._attn_implementation = chosen  # noqa: SLF001 (what from_pretrained sets)
        assert compat.attention_implementation(BertModel(config).config) == chosen


def test_accelerate_state_reset_forgets_the_precision_and_keeps_the_process():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    compat.reset_accelerator_state()
    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
    assert Accelerator(cpu=True).mixed_precision == "bf16"  # the singleton: the first job's setting stays
    compat.reset_accelerator_state()
    assert AcceleratorState._shared_state == {}
    assert PartialState._shared_state != {}  # the process group stays
    assert Accelerator(cpu=True).mixed_precision == "no"  # the next job sets its own precision
    compat.reset_accelerator_state()


def test_dataset_fingerprint_follows_the_content():
    from datasets import Dataset

    data = Dataset.from_dict({"text": ["a", "b"]})
    fingerprint = compat.dataset_fingerprint(data)
    assert isinstance(fingerprint, str) and len(fingerprint) >= 8
    changed = data.map(lambda row: {"text": row["text"] + "!"})
    assert compat.dataset_fingerprint(changed) != fingerprint
    assert compat.dataset_fingerprint(data) == fingerprint


def test_no_split_modules_are_the_transformer_blocks_a_model_names():
    import transformers

    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    bert = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32)  # fmt: skip
    assert compat.no_split_modules(transformers.AutoModelForCausalLM.from_config(llama)) == [
        "LlamaDecoderLayer"
    ]
    assert compat.no_split_modules(transformers.BertForSequenceClassification(bert)) == [
        "BertEmbeddings",
        "BertLayer",
    ]


def test_keep_in_fp32_modules_are_what_the_model_class_keeps():
    import transformers

    t5 = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    assert set(compat.keep_in_fp32_modules(transformers.T5ForConditionalGeneration(t5))) == {"wo"}
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    assert not compat.keep_in_fp32_modules(transformers.AutoModelForCausalLM.from_config(llama))


def test_dora_layer_class_is_the_layer_peft_adds_per_adapted_linear():
    """One DoRA layer per adapted Linear: 13 in a 2-layer BERT (six per layer and the pooler)."""
    import peft
    import transformers

    config = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, num_labels=3)  # fmt: skip
    adapter = peft.LoraConfig(r=4, target_modules="all-linear", task_type="SEQ_CLS", use_dora=True)
    model = peft.get_peft_model(transformers.AutoModelForSequenceClassification.from_config(config), adapter)
    dora = compat.dora_layer_class()
    assert dora.__name__ == "DoraLinearLayer"
    assert sum(isinstance(module, dora) for module in model.modules()) == 13
