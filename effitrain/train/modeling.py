"""Model and tokenizer, built once in shared code for every backend (and on ``meta`` for estimates)."""

from __future__ import annotations

import logging
import os

import torch
from omegaconf import DictConfig, OmegaConf

from effitrain.config.errors import invalid
from effitrain.train.adapters.build import keep_cpu_layout
from effitrain.train.adapters.configs import keeping_head
from effitrain.util.assets import hub_unreachable

log = logging.getLogger(__name__)


def cache_only(name_or_path: str) -> bool:
    """``local_files_only`` for ``from_pretrained``: a local folder, or a hub name while the hub is
    unreachable (the probe runs only for a hub name)."""
    return os.path.isdir(os.path.expanduser(str(name_or_path))) or hub_unreachable()


def build_tokenizer(model_cfg: DictConfig):
    """The tokenizer of ``model.tokenizer`` (default: ``model.name_or_path``).

    A randomly initialized model whose tokenizer cannot be loaded (no hub offline) falls back to
    ``model.offline_tokenizer`` when the config names one.

    Raises:
        ConfigError: the tokenizer cannot be loaded.
    """
    from transformers import AutoTokenizer

    source = model_cfg.get("tokenizer") or model_cfg.name_or_path
    fallback = model_cfg.get("offline_tokenizer")
    # A random-init model with an offline fallback is an offline memory study: the local cache only.
    study = model_cfg.init == "random" and bool(fallback)
    key = "model.tokenizer" if model_cfg.get("tokenizer") else "model.name_or_path"
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source,
            trust_remote_code=model_cfg.trust_remote_code,
            local_files_only=study or cache_only(source),
        )
    except (OSError, ValueError) as error:
        if study:
            # said once, in the run's summary (model/tokenizer_note), not on every build
            note = f"tokenizer {source} unavailable offline ({type(error).__name__}); used {fallback}"
            log.debug(note)
            tokenizer = AutoTokenizer.from_pretrained(fallback)
            tokenizer.effitrain_note = note
            return tokenizer
        raise invalid(key, source, f"the tokenizer could not be loaded ({type(error).__name__})") from None
    if len(tokenizer) <= len(tokenizer.all_special_tokens):
        # a folder with a config but no vocabulary loads a tokenizer of special tokens alone, which
        # maps every word to [UNK]: nothing could be learned
        raise invalid(key, source, f"it holds no vocabulary (the tokenizer knows only its {len(tokenizer)} "
                      "special tokens): give a folder with the tokenizer's files") from None  # fmt: skip
    return tokenizer


def tokenizer_for_size(model_cfg: DictConfig):
    """The tokenizer a run of ``model_cfg`` would use, loaded once per process for builds that read
    only its size and padding id (estimates on ``meta``)."""
    key = (model_cfg.get("tokenizer") or model_cfg.name_or_path, model_cfg.get("offline_tokenizer"),
           model_cfg.init, model_cfg.trust_remote_code)  # fmt: skip
    if key not in _SIZING_TOKENIZERS:
        _SIZING_TOKENIZERS[key] = build_tokenizer(model_cfg)
    return _SIZING_TOKENIZERS[key]


_SIZING_TOKENIZERS: dict = {}


def build_config(model_cfg: DictConfig, num_labels: int | None, tokenizer=None, causal: bool = False):
    """The architecture: ``name_or_path``'s own config for ``init=pretrained``, for a local folder
    holding a ``config.json``, and when ``model.architecture`` is empty; else ``model.architecture``
    (the rule of :func:`effitrain.config.model_spec.uses_named_config`, which the checks read too).

    ``num_labels``: the classification head's size (None: a model without one, a causal LM).
    ``causal``: built as a decoder (``is_decoder=True``: an encoder type such as BERT then masks
    later tokens; decoder types ignore it)."""
    from transformers import AutoConfig

    from effitrain.config.model_spec import uses_named_config

    overrides = OmegaConf.to_container(model_cfg.config_overrides, resolve=True)
    architecture = OmegaConf.to_container(model_cfg.architecture, resolve=True)
    config = None
    if uses_named_config(model_cfg):
        try:
            config = AutoConfig.from_pretrained(
                model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code,
                local_files_only=cache_only(model_cfg.name_or_path), **overrides,
            )  # fmt: skip
        except (OSError, ValueError) as error:
            if not architecture:
                raise invalid(
                    "model.name_or_path",
                    model_cfg.name_or_path,
                    f"no model config could be loaded ({type(error).__name__})",
                ) from None
    if config is None:  # random init, or the hub is out of reach: the config's own architecture
        architecture = dict(architecture)
        config = AutoConfig.for_model(architecture.pop("model_type"), **architecture, **overrides)
    if num_labels is not None:
        config.num_labels = num_labels
    if causal:
        config.is_decoder = True
    if tokenizer is not None:
        if model_cfg.init == "random":
            # A fresh embedding matrix is sized to the tokenizer actually used.
            config.vocab_size = len(tokenizer)
        if tokenizer.pad_token_id is not None:
            config.pad_token_id = tokenizer.pad_token_id
    return config


def model_config(model_cfg: DictConfig, num_labels: int | None, tokenizer=None,
                 auto_class: str = "AutoModelForSequenceClassification"):  # fmt: skip
    """The config :func:`build_model` builds ``auto_class``'s model from (:func:`build_config`), and
    the one an estimate builds on ``meta`` (:func:`effitrain.train.adapters.build.model_on_meta`)."""
    if tokenizer is None and model_cfg.init == "random":
        # one rule for runs and estimates: a fresh embedding is sized to the tokenizer a run uses
        tokenizer = tokenizer_for_size(model_cfg)
    return build_config(model_cfg, num_labels, tokenizer, causal=auto_class == "AutoModelForCausalLM")


def build_model(
    model_cfg: DictConfig,
    num_labels: int | None,
    tokenizer=None,
    device: str | None = None,
    auto_class: str = "AutoModelForSequenceClassification",
    quantization=None,
):
    """The model of ``auto_class`` (the task's: a sequence classifier with a ``num_labels`` head, or
    a causal LM with ``num_labels=None``).

    ``init=pretrained`` loads weights from ``name_or_path``; ``init=random`` (or ``device="meta"``,
    used by estimates) builds the architecture only, so no weights are read. ``quantization``: a
    ``BitsAndBytesConfig`` (``adapter=qlora``, :func:`effitrain.train.adapters.configs.quantization_config`)
    that ``from_pretrained`` loads the weights through.
    """
    import transformers

    auto = getattr(transformers, auto_class)
    config = model_config(model_cfg, num_labels, tokenizer, auto_class)
    if quantization is not None and device != "meta":
        with torch.device("meta"):  # the head's names, nothing allocated
            skeleton = auto.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
        quantization = keeping_head(quantization, skeleton)
    if model_cfg.init == "pretrained" and device != "meta":
        model = auto.from_pretrained(
            model_cfg.name_or_path, config=config, trust_remote_code=model_cfg.trust_remote_code,
            local_files_only=cache_only(model_cfg.name_or_path), quantization_config=quantization,
        )  # fmt: skip
    else:
        with torch.device(device or "cpu"):
            model = auto.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
        if quantization is not None and device != "meta":
            model = quantized(model, auto, quantization, model_cfg.trust_remote_code)
    if quantization is not None and device != "meta":
        keep_cpu_layout(model)
    return model


def quantized(model, auto, quantization, trust_remote_code: bool):
    """``model``'s weights loaded through ``quantization`` by ``from_pretrained``, as a pretrained
    model's are: transformers quantizes only while it loads weights (``from_config`` takes no
    quantization config), so a randomly initialized model is saved to a temporary folder first."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="effitrain-quantize-") as folder:
        model.save_pretrained(folder)
        loaded = auto.from_pretrained(
            folder, quantization_config=quantization, trust_remote_code=trust_remote_code,
            local_files_only=True,
        )  # fmt: skip
    # named as from_config leaves a model, not by the folder that is gone (peft's saved adapter
    # records the name, and looks for a config there)
    loaded.name_or_path = loaded.config.name_or_path = model.name_or_path
    return loaded
