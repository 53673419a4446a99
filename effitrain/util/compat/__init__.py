"""The private APIs of effitrain's dependencies, in one place: torch, Hugging Face's libraries
(transformers, accelerate, datasets, peft), OmegaConf and Hydra, and third-party optimizers
(torchao, APOLLO).

An underscore name (or an internal module) is no promise: any release may rename or drop it.
effitrain reaches each one only through this package, behind the version guard of ``guard``: it is
used only on releases below ``CHECKED_BELOW`` (pyproject.toml's upper bounds, the releases it was
checked on) and only when it is there; otherwise the entry's fallback says what happens (a slower
path, an unpatched mask, or an error that names the API). ``tests/util/compat/`` checks every entry
on the installed releases and fails loudly, naming the entry, when an upgrade changes one, or when
pyproject.toml admits a release this package was not checked on.

One module per library family: ``memtracker`` (torch's MemTracker and what effitrain overrides of
it), ``pytorch`` (torch's other internals), ``huggingface``, ``omegaconf_hydra``, ``optimizers``.
Callers import the entries from here.

Checked on torch 2.13, transformers 5.24, accelerate 1.15, datasets 5.2, peft 0.21, omegaconf 2.3,
hydra-core 1.3, apollo-torch 1.0, torchao 0.18.
"""

from effitrain.util.compat.guard import CHECKED_BELOW, checked, missing, private
from effitrain.util.compat.huggingface import (
    MASK_SKIPPING,
    attention_implementation,
    checkpointing_wrapped,
    dataset_fingerprint,
    dora_layer_class,
    keep_in_fp32_modules,
    mask_skipping_replaced,
    no_split_modules,
    reset_accelerator_state,
)
from effitrain.util.compat.memtracker import (
    OFFLOADED_HOST,
    counting_like,
    fsdp_mem_tracker_class,
    mem_tracker_class,
    recomputation_tracked,
    step_peak_tracker_class,
    storages_counted_as,
    storages_offloaded,
    timeline_tracker_class,
)
from effitrain.util.compat.omegaconf_hydra import config_node, job_return, job_return_value
from effitrain.util.compat.optimizers import (
    TORCHAO_ADAM_BASE,
    apollo_projector,
    apollo_projector_state,
    torchao_moments_owner,
)
from effitrain.util.compat.pytorch import (
    SDPA_KERNEL_OPS,
    adam_step_dtype,
    batch_norm_classes,
    compile_seconds,
    dynamo_left_unimported,
    fake_process_group,
    fake_tensor_mode,
    is_fake,
    is_traceable_wrapper_subclass,
    outside_fake_mode,
    sdpa_kernel_op,
    tree_map,
    values_assumed,
)

__all__ = [
    "CHECKED_BELOW", "MASK_SKIPPING", "OFFLOADED_HOST", "SDPA_KERNEL_OPS", "TORCHAO_ADAM_BASE", "adam_step_dtype",
    "apollo_projector", "apollo_projector_state", "attention_implementation", "batch_norm_classes",
    "checked", "checkpointing_wrapped", "compile_seconds", "config_node", "counting_like",
    "dataset_fingerprint", "dora_layer_class", "dynamo_left_unimported", "fake_process_group", "fake_tensor_mode",
    "fsdp_mem_tracker_class", "is_fake", "is_traceable_wrapper_subclass", "job_return", "job_return_value",
    "keep_in_fp32_modules", "mask_skipping_replaced", "mem_tracker_class", "missing",
    "no_split_modules", "outside_fake_mode", "private", "recomputation_tracked", "reset_accelerator_state",
    "sdpa_kernel_op", "step_peak_tracker_class", "storages_counted_as", "storages_offloaded", "timeline_tracker_class", "torchao_moments_owner",
    "tree_map", "values_assumed",
]  # fmt: skip
