"""An adapted model's checkpoint files, as peft writes and reads them (``adapter_config.json``,
``adapter_model.safetensors``): the adapter's weights and the head it trains. The frozen base is never
saved: a run rebuilds it as it did (the same weights, the same seed, the same quantization).
:class:`effitrain.train.checkpoint.Checkpointer` calls these in place of its full-model files."""

from __future__ import annotations

from effitrain.train.adapters import is_adapted


def save_adapter(model, folder) -> bool:
    """An adapted model's checkpoint weights, as peft saves them, so that
    ``PeftModel.from_pretrained(base, folder)`` and the Trainer's resume load a checkpoint as it is.
    False, and nothing written, for a model without an adapter."""
    if not is_adapted(model):
        return False
    model.save_pretrained(folder)
    return True


def load_adapter(model, folder, device) -> bool:
    """The weights :func:`save_adapter` saved in ``folder`` loaded into ``model`` (peft's
    ``set_peft_model_state_dict``); False for a model without an adapter.

    Raises:
        RuntimeError: the file holds weights the model has no place for.
    """
    if not is_adapted(model):
        return False
    from peft import set_peft_model_state_dict
    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import load_file

    state = load_file(folder / SAFETENSORS_WEIGHTS_NAME, device=str(device))
    unexpected = set_peft_model_state_dict(model, state).unexpected_keys
    if unexpected:
        raise RuntimeError(
            f"{folder / SAFETENSORS_WEIGHTS_NAME} holds weights the model lacks: {unexpected[:3]}"
        )
    return True
