"""Every option of every config group composes and builds; bad values are rejected up front."""

from __future__ import annotations

import json

import pytest
import torch
from hydra.utils import instantiate

from effitrain.commands.train_command import preflight
from effitrain.config.errors import ConfigError, ConfigErrors
from effitrain.config.load import load
from effitrain.config.registry import CONF_DIR, group_options
from effitrain.config.validate import validate
from effitrain.train.modeling import build_model, build_tokenizer
from effitrain.train.optim import build_optimizer, param_groups
from tests.helpers.bad_inputs import PREFLIGHT, every_nth_fast, fill
from tests.helpers.run import TINY, compose, optimizer_option

GROUPS = ["optimizer", "backend", "compile", "precision", "model", "data", "logger"]


def test_groups_hold_the_options_of_the_contract():
    expected = {
        "optimizer": {"adamw", "adafactor", "adam8bit", "adamw_fused", "lion", "apollo", "adamw4bit"},
        "backend": {"accelerator", "trainer"},
        "compile": {"off", "on"},
        "precision": {"fp32", "bf16", "fp16"},
        "model": {"minilm", "tiny", "distilbert_base_cased"},
        "data": {"drug_reviews", "synthetic", "hub"},
        "logger": {"none", "wandb"},
    }
    for group, options in expected.items():
        assert options <= set(group_options(group)), group


@pytest.mark.parametrize("option", [optimizer_option(name) for name in group_options("optimizer")])
def test_every_optimizer_builds_the_real_class_with_its_lr(option):
    cfg = compose(f"optimizer={option}")
    model = build_model(cfg.model, 3, build_tokenizer(cfg.model))
    optimizer = build_optimizer(cfg.optimizer, model, weight_decay=0.01)
    module, _, name = cfg.optimizer._target_.rpartition(".")
    assert type(optimizer).__name__ == name and type(optimizer).__module__.startswith(module.split(".")[0])
    # every parameter once, with the configured lr (torchao keeps it as a float32 tensor), and
    # weight decay as effitrain's two groups decide (APOLLO splits them further, keeping that)
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    assert (
        sum(len(g["params"]) for g in optimizer.param_groups) == len(groups) == len(list(model.parameters()))
    )
    assert [float(g["lr"]) for g in groups.values()] == pytest.approx(
        [cfg.optimizer.lr] * len(groups), rel=1e-6
    )
    for group in param_groups(model, 0.01):
        assert {groups[id(p)]["weight_decay"] for p in group["params"]} == {group["weight_decay"]}


def test_an_optimizer_whose_package_is_missing_is_refused_in_one_line(monkeypatch, capsys):
    import importlib.util
    import sys

    from effitrain.config.registry import installed_optimizers

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` fails, as when not installed
    monkeypatch.delitem(sys.modules, "torchao.optim", raising=False)
    with pytest.raises(ConfigError) as error:
        validate(compose("optimizer=adamw4bit"))
    assert str(error.value) == (
        "optimizer._target_='torchao.optim.AdamW4bit' is invalid: needs torchao, which is not installed: "
        "pip install 'effitrain[torchao]'"
    )
    # estimate and plan cover the options that can be built here, and say which they left out
    assert installed_optimizers(["adamw", "adamw4bit", "lion"]) == ["adamw", "lion"]
    assert capsys.readouterr().err == (
        "effitrain: optimizer=adamw4bit left out: torchao is not installed (pip install 'effitrain[torchao]')\n"
    )


@pytest.mark.parametrize("option", group_options("backend"))
def test_every_backend_resolves_to_its_fit(option):
    fit = instantiate(compose(f"backend={option}").backend)
    assert fit.func.__name__ == "fit" and fit.func.__module__ == f"effitrain.backends.{option}"


@pytest.mark.parametrize("option", group_options("precision"))
def test_every_precision_validates_or_names_cuda(option):
    cfg = compose(f"precision={option}")
    if option == "fp16" and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^precision='fp16' is invalid: fp16 needs a CUDA device"):
            validate(cfg)
    else:
        validate(cfg)
        assert cfg.precision.mixed_precision == {"fp32": "no"}.get(option, option)


def test_minilm_loads_pretrained_weights_from_its_package():
    import logging

    cfg = compose("model=minilm")
    tokenizer = build_tokenizer(cfg.model)
    records = []
    capture = logging.Handler()
    capture.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("transformers.modeling_utils").addHandler(capture)
    try:
        model = build_model(cfg.model, 3, tokenizer)
    finally:
        logging.getLogger("transformers.modeling_utils").removeHandler(capture)
    # transformers' coloured load report, as one plain line: the new head is what was missing
    assert records == [
        f"BertForSequenceClassification from {cfg.model.name_or_path}: "
        "missing: classifier.bias, classifier.weight (newly initialized)"
    ]
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    assert sum(p.numel() for p in model.bert.parameters()) == 22_713_216
    # pretrained, not random: the word embeddings are those stored in the package
    from safetensors.torch import load_file

    stored = load_file(f"{cfg.model.name_or_path}/model.safetensors")
    key = next(k for k in stored if k.endswith("word_embeddings.weight"))
    torch.testing.assert_close(model.bert.embeddings.word_embeddings.weight, stored[key])


def test_distilbert_random_init_builds_offline_with_the_architecture():
    cfg = compose("model=distilbert_base_cased", "model.init=random")
    tokenizer = build_tokenizer(cfg.model)  # no hub: falls back to the offline tokenizer
    assert tokenizer.effitrain_note.startswith("tokenizer distilbert-base-cased unavailable offline")
    model = build_model(cfg.model, 3, tokenizer)
    assert model.config.model_type == "distilbert" and model.config.n_layers == 6
    assert model.config.vocab_size == len(tokenizer) == 30522
    on_meta = build_model(cfg.model, 3, tokenizer, device="meta")
    assert next(on_meta.parameters()).device.type == "meta"
    assert sum(p.numel() for p in on_meta.parameters()) == sum(p.numel() for p in model.parameters())


def test_an_unreachable_hub_is_found_by_one_connection_attempt(monkeypatch):
    """Without HF_HUB_OFFLINE, a hub that does not answer sends every load to the local cache (no
    retries); a hub that listens, or any hub behind a proxy, is asked."""
    import socket

    from huggingface_hub import constants

    from effitrain.util.assets import hub_unreachable

    def probe(endpoint: str, offline: bool = False) -> bool:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        hub_unreachable.cache_clear()
        try:
            return hub_unreachable()
        finally:
            hub_unreachable.cache_clear()  # no answer of this test outlives it

    for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with socket.create_server(("127.0.0.1", 0)) as server:
        listening = f"https://127.0.0.1:{server.getsockname()[1]}"
        assert probe(listening) is False
        assert probe(listening, offline=True) is True
    assert probe(listening) is True  # the server is closed: the port refuses connections
    assert probe("https://no-such-host.invalid") is True
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    assert probe(listening) is False  # the proxy may reach it: the hub client decides


@pytest.mark.slow
def test_distilbert_pretrained_without_hub_is_a_clear_error():
    cfg = compose("model=distilbert_base_cased")
    with pytest.raises(ConfigError, match=r"^model.name_or_path='distilbert-base-cased' is invalid"):
        build_tokenizer(cfg.model)


@pytest.mark.parametrize("option", ["drug_reviews", "synthetic"])
def test_packaged_and_generated_data_load(option):
    raw = instantiate(compose(f"data={option}").data)
    assert set(raw.train.column_names) == {"text", "label"}
    if option == "drug_reviews":
        assert (len(raw.train), len(raw.eval)) == (600, 379)
        assert raw.label_names == ["negative", "neutral", "positive"]
        assert not any("&#039;" in t or t.startswith('"') for t in raw.train["text"])
    else:
        assert (len(raw.train), len(raw.eval)) == (256, 64)


def test_hub_data_reads_local_files_with_load_dataset(tmp_path):
    (tmp_path / "train.csv").write_text("review,stars\ngood stuff,pos\nbad stuff,neg\nfine,pos\n")
    (tmp_path / "test.csv").write_text("review,stars\nokay,pos\nawful,neg\n")
    cfg = compose(
        "data=hub",
        "data.load_args.path=csv",
        f"+data.load_args.data_files={{train: {tmp_path}/train.csv, test: {tmp_path}/test.csv}}",
        "data.text_column=review",
        "data.label_column=stars",
    )
    raw = instantiate(cfg.data)
    assert raw.label_names == ["neg", "pos"]
    assert raw.train["label"] == [1, 0, 1] and raw.eval["text"] == ["okay", "awful"]


FAST_PREFLIGHT = every_nth_fast(PREFLIGHT, 3)  # every row in the full suite, every third in the fast one


@pytest.mark.parametrize("overrides, message", FAST_PREFLIGHT)
def test_preflight_names_key_value_and_what_is_allowed_in_one_line(csv_files, overrides, message):
    overrides, message = fill(overrides, message, csv_files)
    with pytest.raises(ConfigError) as error:
        preflight(TINY + overrides)
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_preflight_reports_every_problem_of_a_config_at_once():
    with pytest.raises(ConfigErrors) as error:
        preflight(TINY + ["seed=x", "epochs=0", "max_grad_norm=nan"])
    assert error.value.problems == [
        "seed='x' is invalid: must be an integer",
        "epochs=0 is invalid: must be an integer >= 1",
        "max_grad_norm=nan is invalid: must be >= 0 (0 disables clipping)",
    ]


def test_preflight_checks_every_job_of_a_sweep_and_accepts_hydra_syntax():
    preflight(TINY + ["-m", "optimizer=adamw, adafactor", 'backend="trainer"'])  # valid: no error
    with pytest.raises(ConfigError) as error:  # Adafactor takes beta1, AdamW does not
        preflight(TINY + ["-m", "optimizer=adafactor,adamw", "+optimizer.beta1=0.9"])
    assert str(error.value).startswith(
        "the sweep's job optimizer=adamw:\noptimizer.beta1=0.9 is invalid: AdamW takes no such argument"
    )
    with pytest.raises(ConfigError, match=r"micro_batch_size=0 is invalid"):
        preflight(TINY + ["sweep=optimizers", "micro_batch_size=0"])


def test_a_key_added_under_a_swept_group_is_checked_in_each_job_not_in_the_default_option():
    """adapter=none (the default) has no _target_, so +adapter.bias adds a key nothing reads there;
    a sweep over lora and dora reads it in every job, and one that includes none refuses that job."""
    checked: list[int] = []
    assert preflight(TINY + ["-m", "adapter=lora,dora", "+adapter.bias=all"], jobs_checked=checked) is None
    assert checked == [2]
    with pytest.raises(ConfigError) as error:
        preflight(TINY + ["-m", "adapter=lora,none", "+adapter.bias=all"])
    assert str(error.value) == (
        "the sweep's job adapter=none:\nadapter.bias='all' adds a key nothing reads: did you mean adapter._target_?"
    )
    with pytest.raises(ConfigError, match=r"^adapter.bias='all' adds a key nothing reads"):
        preflight(TINY + ["+adapter.bias=all"])  # one run: refused as before


def test_a_sweep_folder_named_by_the_job_number_is_checked_without_a_traceback():
    # ${hydra.job.num} is Hydra's to decide at launch: the preflight leaves the folder to the job
    checked: list[int] = []
    assert (
        preflight(TINY + ["-m", "hydra.sweep.subdir=${hydra.job.num}", "seed=1,2"], jobs_checked=checked)
        is None
    )
    assert checked == [2]


def test_a_deleted_target_argument_is_allowed_and_named_in_the_short_name():
    from effitrain.config.overrides import short_name
    from effitrain.config.registry import group_names

    cfg = load([*TINY, "~optimizer.eps"])
    assert "eps" not in cfg.optimizer  # AdamW's own default applies
    assert short_name(["optimizer=adamw", "~optimizer.eps"], set(), set(group_names())) == "adamw | ~eps"


def test_configs_are_found_through_the_package_search_path_in_the_checkout():
    from tests.helpers.run import REPO

    # pkg://effitrain.conf resolves to the checkout's own conf/ in an editable install (no copy)
    assert CONF_DIR == REPO / "conf"
    assert compose().hydra.runtime.config_sources[1] == {"path": "effitrain.conf", "schema": "pkg",
                                                         "provider": "main"}  # fmt: skip


@pytest.mark.slow
def test_config_overrides_plain_form_is_set_in_the_built_model(tmp_path):
    """``model.config_overrides.key=v`` (no +) works as ``+model.config_overrides.key=v`` does: composed,
    recorded by Hydra in a real run, and in the model's config."""
    import yaml

    from effitrain.train.modeling import build_config
    from tests.helpers.run import train_py

    plain = "model.config_overrides.hidden_dropout_prob=0.0"
    for form in (plain, f"+{plain}"):
        cfg = load([*TINY, form])
        assert build_config(cfg.model, 3).hidden_dropout_prob == 0.0
    assert build_config(load(TINY).model, 3).hidden_dropout_prob == 0.1  # BERT's default: the override counts
    done = train_py(*TINY, plain, "max_steps=1", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-2000:]
    recorded = yaml.safe_load((tmp_path / ".hydra" / "config.yaml").read_text())
    assert recorded["model"]["config_overrides"] == {"hidden_dropout_prob": 0.0}
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "ok"
