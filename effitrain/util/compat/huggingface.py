"""The private APIs of Hugging Face's libraries effitrain uses: transformers (mask skipping, the
checkpointing function, attention, the units never split, the modules kept in fp32), accelerate
(its state's reset), datasets (a dataset's fingerprint) and peft (the DoRA layer).
"""

from __future__ import annotations

import contextlib
import functools

from effitrain.util.compat.guard import missing, private

# --- transformers ------------------------------------------------------------------------------

# transformers decides, per batch, to build no attention mask when nothing is padded (sdpa).
MASK_SKIPPING = ("_ignore_bidirectional_mask_sdpa", "_ignore_causal_mask_sdpa")


@contextlib.contextmanager
def mask_skipping_replaced(follow):
    """Within, each of transformers' ``masking_utils`` deciders in :data:`MASK_SKIPPING` is
    ``follow(original)``; restored on exit. Fallback: a decider that is gone is left alone (the
    prediction then builds the mask transformers builds for padded batches)."""
    from transformers import masking_utils

    originals = {name: private("transformers", masking_utils, name) for name in MASK_SKIPPING}
    for name, original in originals.items():
        if original is not None:
            setattr(masking_utils, name, follow(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            if original is not None:
                setattr(masking_utils, name, original)


def checkpointing_wrapped(model, wrap) -> int:
    """Each of the model's checkpointed layers runs ``wrap(fn)`` where it ran ``fn`` under
    ``torch.utils.checkpoint``, in the forward and in the recomputation alike: transformers'
    ``_gradient_checkpointing_func`` (set by ``gradient_checkpointing_enable``) is wrapped. Returns
    how many layers were; fallback: none (0), which the caller reports."""
    from transformers import PreTrainedModel

    wrapped = 0
    for module in model.modules():
        if isinstance(module, PreTrainedModel):  # it holds the function too, for its layers to take
            continue
        original = private("transformers", module, "_gradient_checkpointing_func")
        if original is not None:
            module._gradient_checkpointing_func = functools.partial(
                lambda checkpoint, fn, *args, **kwargs: checkpoint(wrap(fn), *args, **kwargs), original
            )
            wrapped += 1
    return wrapped


def attention_implementation(config) -> str:
    """The attention a transformers model runs (``PretrainedConfig._attn_implementation``).
    Fallback: sdpa, transformers' default where torch has it."""
    return private("transformers", config, "_attn_implementation") or "sdpa"


def no_split_modules(model) -> list[str]:
    """The class names of the units transformers never splits across devices, its transformer
    blocks (a model's ``_no_split_modules``). Fallback: none (the caller, finding no block, refuses
    to shard the model)."""
    return sorted(private("transformers", model, "_no_split_modules") or ())


def keep_in_fp32_modules(model):
    """The modules a model class keeps in fp32 when quantized or cast (its ``_keep_in_fp32_modules``,
    a list of name parts or None). Fallback: None, as for a class that keeps none (its quantizer
    then also converts those modules)."""
    return private("transformers", model, "_keep_in_fp32_modules")


# --- accelerate --------------------------------------------------------------------------------


def reset_accelerator_state() -> None:
    """Forget accelerate's process-wide precision and compile settings
    (``AcceleratorState._reset_state``), keeping the process group. No fallback: without it a job
    would inherit the previous job's settings, so a missing one is an error."""
    from accelerate.state import AcceleratorState

    reset = private("accelerate", AcceleratorState, "_reset_state")
    if reset is None:
        raise missing("accelerate", "AcceleratorState._reset_state")
    reset(reset_partial_state=False)


# --- datasets ----------------------------------------------------------------------------------


def dataset_fingerprint(dataset) -> str:
    """What a ``datasets.Dataset`` holds, as datasets hashes it (``Dataset._fingerprint``). No
    fallback: the tokenized cache's key needs it."""
    fingerprint = private("datasets", dataset, "_fingerprint")
    if fingerprint is None:
        raise missing("datasets", "Dataset._fingerprint")
    return fingerprint


# --- peft --------------------------------------------------------------------------------------


@functools.cache
def dora_layer_class():
    """peft's DoRA layer (``peft.tuners.lora.dora.DoraLinearLayer``, an internal module: no promise of
    a name or a place); None where peft is not installed. Fallback: None (the step tracker then keeps
    the graph a DoRA layer leaves unused until Python's collector runs: a tracked peak above the run's)."""
    try:
        from peft.tuners.lora import dora
    except ImportError:
        return None
    return private("peft", dora, "DoraLinearLayer")
