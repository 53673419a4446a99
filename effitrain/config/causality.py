"""Whether a decoder lets a position see later tokens: checked on a miniature of its config before
anything is built (``effitrain check``, ``validate``), and on the real model once it is built."""

from __future__ import annotations

import torch


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


def miniature_decoder(config, trust_remote_code: bool = False):
    """The causal LM of ``config``'s miniature (:func:`miniature`), built on the CPU; None when it
    cannot be built (the build of the real model reports its own errors)."""
    from transformers import AutoModelForCausalLM

    small = miniature(config)
    if small is None:
        return None
    try:
        small.is_decoder = True
        with torch.device("cpu"):
            return AutoModelForCausalLM.from_config(small, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - the build of the real model reports its own errors
        return None


def causal_check(config, trust_remote_code: bool = False) -> bool | None:
    """Whether a decoder built from ``config``'s miniature lets a position see later tokens
    (:func:`sees_later_tokens`); None when the miniature cannot be built or checked (the check of
    the real model after it is built then decides)."""
    model = miniature_decoder(config, trust_remote_code)
    if model is None:
        return None
    try:
        return sees_later_tokens(model)
    except Exception:  # noqa: BLE001 - the build of the real model reports its own errors
        return None
