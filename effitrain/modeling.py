"""Model and tokenizer, built once in shared code for every backend (and on ``meta`` for estimates)."""

from __future__ import annotations

import functools
import logging
import os

import torch
from omegaconf import DictConfig, OmegaConf

from effitrain.config import invalid

log = logging.getLogger(__name__)


@functools.cache
def hub_unreachable() -> bool:
    """No route to the model hub: one connection attempt, name lookup included, given 2 s per
    process (skipped behind a proxy; True under ``HF_HUB_OFFLINE``). Then configs, tokenizers and
    weights come from the local cache only, instead of waiting out the hub client's retries
    (about 25 s per file)."""
    import socket
    import threading
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    endpoint = urllib.parse.urlparse(constants.ENDPOINT)
    proxies = urllib.request.getproxies()
    if proxies.get(endpoint.scheme) or proxies.get("all"):
        return False
    done, answered = threading.Event(), []

    def connect():
        try:
            port = endpoint.port or {"http": 80}.get(endpoint.scheme, 443)
            socket.create_connection((endpoint.hostname, port), timeout=2).close()
            answered.append(True)
        except (OSError, ValueError):
            pass
        done.set()

    # a thread, so that a name lookup that hangs (no resolver) is bounded too
    threading.Thread(target=connect, daemon=True, name="effitrain-hub-probe").start()
    if done.wait(2.0) and answered:
        return False
    log.warning("the hub at %s did not answer: configs, tokenizers and weights from the local cache only",
                constants.ENDPOINT)  # fmt: skip
    return True


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
    try:
        return AutoTokenizer.from_pretrained(
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
        key = "model.tokenizer" if model_cfg.get("tokenizer") else "model.name_or_path"
        raise invalid(key, source, f"the tokenizer could not be loaded ({type(error).__name__})") from None


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
    (the rule of :func:`effitrain.config.uses_named_config`, which the checks read too).

    ``num_labels``: the classification head's size (None: a model without one, a causal LM).
    ``causal``: built as a decoder (``is_decoder=True``: an encoder type such as BERT then masks
    later tokens; decoder types ignore it)."""
    from transformers import AutoConfig

    from effitrain.config import uses_named_config

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


def build_model(
    model_cfg: DictConfig,
    num_labels: int | None,
    tokenizer=None,
    device: str | None = None,
    auto_class: str = "AutoModelForSequenceClassification",
):
    """The model of ``auto_class`` (the task's: a sequence classifier with a ``num_labels`` head, or
    a causal LM with ``num_labels=None``).

    ``init=pretrained`` loads weights from ``name_or_path``; ``init=random`` (or ``device="meta"``,
    used by estimates) builds the architecture only, so no weights are read.
    """
    import transformers

    auto = getattr(transformers, auto_class)
    if tokenizer is None and model_cfg.init == "random":
        # one rule for runs and estimates: a fresh embedding is sized to the tokenizer a run uses
        tokenizer = tokenizer_for_size(model_cfg)
    config = build_config(model_cfg, num_labels, tokenizer, causal=auto_class == "AutoModelForCausalLM")
    if model_cfg.init == "pretrained" and device != "meta":
        return auto.from_pretrained(
            model_cfg.name_or_path, config=config, trust_remote_code=model_cfg.trust_remote_code,
            local_files_only=cache_only(model_cfg.name_or_path),
        )  # fmt: skip
    with torch.device(device or "cpu"):
        return auto.from_config(config, trust_remote_code=model_cfg.trust_remote_code)


def enable_activation_checkpointing(model) -> None:
    """Recompute each layer's activations in backward (``gradient_checkpointing=true``), in the
    non-reentrant form: exact gradients, and it works with torch.compile and DDP. A decoder's
    key/value cache is switched off first, as transformers would do with a warning on each run."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise invalid(
            "gradient_checkpointing", True, f"{type(model).__name__} cannot recompute activations: give false"
        )
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def sees_later_tokens(model, position: int = 5, length: int = 8) -> bool:
    """Whether the model's output at a position before ``position`` changes when the token at
    ``position`` changes: True for a model that is not causal (an encoder), whose next-token
    loss would be meaningless. One forward pass of ``length`` tokens, twice, in eval mode."""
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (1, length), generator=generator)
    changed = ids.clone()
    changed[0, position] = (ids[0, position] + 1 + vocab // 2) % vocab
    device = next(model.parameters()).device
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        before, after = (
            model(input_ids=x.to(device), attention_mask=mask.to(device)).logits[0, :position].float().cpu()
            for x in (ids, changed)
        )
    model.train(was_training)
    return not torch.allclose(before, after, rtol=1e-4, atol=1e-5)


def miniature(config):
    """A one-layer, 16-wide copy of ``config`` (same type, same settings otherwise), cheap to build
    on the CPU: for up-front checks of how the architecture behaves. None when the type will not
    shrink this way."""
    values = config.to_dict()
    for derived in ("head_dim", "d_head", "d_kv"):  # recomputed from the new width
        values.pop(derived, None)
    names = getattr(config, "attribute_map", {})
    small = {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2,
             "intermediate_size": 32}  # fmt: skip
    for key, value in small.items():
        real = names.get(key, key)
        if real in values:
            values[real] = value
    try:
        return type(config).from_dict(values)
    except Exception:  # noqa: BLE001 - a type with other constraints: no miniature
        return None


def causal_check(config, trust_remote_code: bool = False) -> bool | None:
    """Whether a decoder built from ``config``'s miniature lets a position see later tokens
    (:func:`sees_later_tokens`); None when the miniature cannot be built (the check of the real
    model after it is built then decides)."""
    from transformers import AutoModelForCausalLM

    small = miniature(config)
    if small is None:
        return None
    try:
        small.is_decoder = True
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(small, trust_remote_code=trust_remote_code)
        return sees_later_tokens(model)
    except Exception:  # noqa: BLE001 - the build of the real model reports its own errors
        return None
