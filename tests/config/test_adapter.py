"""The adapter group's checks (effitrain/train/adapters/build.py, the build on meta that validation is
handed) beyond the table of bad inputs."""

from __future__ import annotations

import pytest

from effitrain.config.errors import ConfigError
from effitrain.config.load import apply_adapter_lr
from effitrain.config.validate import validate as validate_config
from effitrain.train.adapters import build as adapter_checks
from tests.helpers.run import compose


def validate(cfg):
    """Validation as the front door and a run call it: with the build on meta."""
    validate_config(cfg, builds=adapter_checks.check_builds)


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

    from effitrain.train.adapters.configs import lora_config
    from effitrain.train.tasks import Classification

    config = DistilBertConfig(vocab_size=100, dim=32, hidden_dim=64, n_layers=1, n_heads=2, num_labels=3)
    model = DistilBertForSequenceClassification(config)
    wrapped = get_peft_model(model, lora_config(compose("adapter=lora").adapter, Classification, model))
    trained = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    head = {n for n in trained if "classifier" in n}
    assert head == {f"base_model.model.{m}.modules_to_save.default.{w}" for m in ("pre_classifier", "classifier")
                    for w in ("weight", "bias")}  # fmt: skip
    assert sum(".lora_A." in n for n in trained) == 6  # q, k, v, out, two FFN Linear layers of the one block


def test_the_saved_adapter_config_lists_each_module_to_save_once(tmp_path):
    """peft appends its own "classifier" and "score" to the head effitrain names: the file a user
    loads lists every module once, the head first."""
    import json

    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from effitrain.train.adapters.build import apply_adapter
    from effitrain.train.tasks import Classification

    config = DistilBertConfig(vocab_size=100, dim=32, hidden_dim=64, n_layers=1, n_heads=2, num_labels=3)
    wrapped = apply_adapter(DistilBertForSequenceClassification(config), compose("adapter=lora").adapter,
                            Classification)  # fmt: skip
    wrapped.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())["modules_to_save"]
    assert saved == ["pre_classifier", "classifier", "score"]


def tiny_classifier(model_type: str):
    """A one-block classifier of ``model_type`` on ``meta`` (shapes only)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    values = {
        "bert": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37),
        "distilbert": dict(dim=32, n_layers=1, n_heads=2, hidden_dim=37),
        "llama": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                      pad_token_id=0),
    }[model_type]  # fmt: skip
    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(
            AutoConfig.for_model(model_type, vocab_size=100, num_labels=3, **values)
        )


# every module between the base model's output and the logits, as each architecture's forward reads them
HEADS = {
    "bert": ["bert.pooler", "classifier"],
    "distilbert": ["pre_classifier", "classifier"],
    "llama": ["score"],
}


@pytest.mark.parametrize("model_type", sorted(HEADS))
def test_the_whole_head_trains_in_full_and_gets_no_lora(model_type):
    from peft import get_peft_model

    from effitrain.train.adapters.configs import head_modules, lora_config
    from effitrain.train.tasks import Classification

    model = tiny_classifier(model_type)
    head = HEADS[model_type]
    assert head_modules(model) == head
    wanted = {f"{m}.{w}" for m in head for w, _ in model.get_submodule(m).named_parameters()}
    wrapped = get_peft_model(model, lora_config(compose("adapter=lora").adapter, Classification, model))
    trained = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    in_full = {n.removeprefix("base_model.model.").replace(".modules_to_save.default", "") for n in trained
               if ".modules_to_save." in n}  # fmt: skip
    assert in_full == wanted
    assert all(".lora_" in n or ".modules_to_save." in n for n in trained)
    assert not [n for n in trained if ".lora_" in n and any(f".{m}." in n for m in head)]


@pytest.mark.parametrize(
    "overrides, lr",
    [
        (["adapter=none"], 2e-4),  # adamw's
        (["adapter=lora"], 1e-3),
        (["adapter=qlora"], 1e-3),
        (["adapter=dora", "adapter.lr=5e-4"], 5e-4),
        (["adapter=lora", "adapter.lr=null"], 2e-4),
        (["adapter=lora", "optimizer.lr=3e-4"], 3e-4),  # the command line's own choice wins
        (["adapter=lora", "optimizer=lion"], 1e-3),
    ],
)
def test_an_adapter_trains_at_its_lr_unless_the_command_line_sets_the_optimizers(overrides, lr):
    cfg = compose(*overrides)
    assert apply_adapter_lr(cfg) == (cfg.optimizer.lr != compose(*overrides).optimizer.lr)
    assert cfg.optimizer.lr == lr


# docs/extending.md, "Adding an adapter kind": another peft config class is a node alone
OTHER_KINDS = {
    "ia3": {"_target_": "peft.IA3Config", "target_modules": ["query", "value", "intermediate.dense"],
            "feedforward_modules": ["intermediate.dense"], "lr": 1e-3},
    "vera": {"_target_": "peft.VeraConfig", "r": 8, "target_modules": ["query", "value"], "lr": 1e-3},
}  # fmt: skip


REFUSED = {  # a target the model lacks, in one line: peft's own words for VeRA's refusal
    "ia3": "adapter.target_modules=['nope'] is invalid: matches no module of BertForSequenceClassification",
    "vera": "adapter.target_modules=['nope'] is invalid: peft cannot wrap it: No layers types compatible with VeRA",
}


@pytest.mark.parametrize("kind, trainable", [("ia3", 1347), ("vera", 1315)])
def test_another_peft_config_is_an_adapter_kind_with_no_code(kind, trainable):
    from omegaconf import OmegaConf, open_dict

    from effitrain.commands.estimate import estimate_memory

    cfg = compose("adapter=lora")
    with open_dict(cfg):
        cfg.adapter = OmegaConf.create(OTHER_KINDS[kind])
    validate(cfg)
    assert cfg.adapter.lr == 1e-3
    row = estimate_memory(cfg, step=False)["chosen"]
    # the tiny BERT's head (pooler 32 x 32 + 32, classifier 32 x 3 + 3) trains in full beside the adapter
    assert row["params_trainable"] == trainable and trainable - 1155 > 0
    with open_dict(cfg):
        cfg.adapter.target_modules = ["nope"]
        cfg.adapter.pop("feedforward_modules", None)
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert str(error.value).startswith(REFUSED[kind])
