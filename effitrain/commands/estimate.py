"""``effitrain estimate``'s engine: a configuration's memory before running it.

    effitrain estimate model=distilbert_base_cased micro_batch_size=16

The model is built on ``meta`` by the run's own builders, so its weights, gradients and optimizer
state are counted from shapes (:mod:`effitrain.memory`); the step peak comes from one training step
traced on fake tensors (:mod:`effitrain.memory.replay`).
"""

from __future__ import annotations

import torch

from effitrain.memory.count import optimizer_params, params_footprint
from effitrain.memory.optimizer_state import estimate_optimizer_state, grads_estimate


def meta_model(cfg):
    """``cfg``'s model built on ``meta`` as a run builds it (its config sized to the tokenizer and the
    data's labels), its adapter (``adapter=lora``...) applied: shapes, nothing allocated, by the one
    build the check and the replay share (:func:`effitrain.train.adapters.build.model_on_meta`). A
    4-bit base (``qlora``) is at full precision here: its packed codes are counted by
    :func:`effitrain.train.adapters.replay.unpacked_4bit_bytes`.

    Raises:
        ConfigError: the model or its adapter cannot be built (one line naming the key).
    """
    from effitrain.train.adapters.build import model_on_meta
    from effitrain.train.modeling import model_config
    from effitrain.train.tasks import build_task

    task = build_task(cfg)
    if task.uses_labels:
        num_labels = cfg.data.get("num_labels") or len(task.load(cfg.data).label_names)
    else:
        num_labels = None
    return model_on_meta(cfg, task, lambda: model_config(cfg.model, num_labels, None, task.auto_class))


def replay_shapes(cfg, model) -> tuple[list[dict], dict]:
    """What :func:`estimate_memory` replays: ``gradient_accumulation_steps`` micro-batches of
    ``micro_batch_size`` x ``max_length`` tokens (the worst case), and an eval batch of
    ``eval_batch_size`` rows, each as the run's collator makes it: segment ids where the tokenizer
    returns them (a classifier's batch holds what the tokenizer gives; a causal LM's, ids and mask
    only), and padding assumed (the model then builds its attention mask) except in packed rows,
    which never hold any."""
    from effitrain.train.tasks import build_task

    task = build_task(cfg)
    tokens = (cfg.micro_batch_size, cfg.max_length)
    batch = {
        "input_ids": (tokens, torch.int64),
        "attention_mask": (tokens, torch.int64),
        "labels": (task.labels_shape(*tokens), torch.int64),
    }
    if task.uses_labels:
        inputs = _tokenizer_inputs(cfg.model)
        if inputs is None:  # no tokenizer to read (offline, not cached): the model's config decides
            inputs = ("token_type_ids",) if getattr(model.config, "type_vocab_size", 0) else ()
        if "token_type_ids" in inputs:
            batch["token_type_ids"] = (tokens, torch.int64)
    evaluation = {key: ((cfg.eval_batch_size, *shape[1:]), dtype) for key, (shape, dtype) in batch.items()}
    padded = not getattr(task, "packing", False)
    return [{**batch, "padded": padded}] * cfg.gradient_accumulation_steps, {**evaluation, "padded": padded}


_INPUT_NAMES: dict[str, tuple | None] = {}  # tokenizer source -> its model_input_names, read once per process


def _tokenizer_inputs(model_cfg) -> tuple | None:
    """The inputs ``model_cfg``'s tokenizer returns (its ``model_input_names``): read from the
    tokenizer itself, as the run's batches are (DeBERTa-v2's returns segment ids its config has no
    embedding for, RoBERTa's none though its config has one); None where it cannot be loaded (an
    estimate needs no tokenizer: a hub model's, offline and not cached)."""
    from effitrain.config.errors import ConfigError
    from effitrain.train.modeling import build_tokenizer

    source = str(model_cfg.get("tokenizer") or model_cfg.name_or_path)
    if source not in _INPUT_NAMES:
        try:
            _INPUT_NAMES[source] = tuple(build_tokenizer(model_cfg).model_input_names)
        except ConfigError:
            _INPUT_NAMES[source] = None
    return _INPUT_NAMES[source]


def estimate_memory(cfg, optimizers: dict | None = None, step: bool = True, device: str = "cpu",
                    cache: bool = False, share: bool = True, steps=None, world_size: int = 1) -> dict:  # fmt: skip
    """Memory of ``cfg``'s run before running it, in bytes, one row per optimizer.

    The static part (weights, gradients, optimizer state) comes from a ``meta`` model: nothing is
    allocated. ``step``: also the step peak by category, from one training step traced on fake
    tensors at the worst case (every micro-batch ``max_length`` tokens), with FLOPs. No weights
    are read: the model's architecture config decides, its vocabulary sized to the
    tokenizer for init=random as in a run (effitrain.train.modeling.build_model).

    ``optimizers`` maps names to optimizer config nodes (default: ``{"chosen": cfg.optimizer}``).
    ``device``: whose kernels the trace replays (``cpu`` or ``cuda``, see
    :func:`effitrain.memory.replay.trace_run`). Each row also holds the run's peak per phase (the
    first step, a later step, evaluation at ``eval_batch_size``): ``run_peak`` and ``run_peak_bytes``,
    and ``trace_source``: how its trace was had (:func:`effitrain.memory.trace_cache.traces_of`, whose
    ``cache``, ``share`` and ``steps`` these are). With ``parallel=fsdp`` the step and run peaks are
    one rank's of ``world_size`` (:func:`effitrain.memory.sharded.trace_sharded`, a full replay per
    optimizer, neither shared nor cached), and the counted totals are named ``whole_model_<key>``
    (:data:`WHOLE_MODEL_KEYS`); an optimizer FSDP refuses has ``unsupported`` instead.
    """
    from effitrain.memory.predicted import leaves_out
    from effitrain.memory.step_peak import CATEGORIES, HOST_OFFLOADED
    from effitrain.memory.trace_cache import traces_of
    from effitrain.train.parallel import strategy_of

    model = meta_model(cfg)
    optimizers = optimizers or {"chosen": cfg.optimizer}
    batches, evaluation = replay_shapes(cfg, model)
    rows = counted_rows(model, optimizers, cfg, batches, evaluation, device, cache)
    if step:
        if strategy_of(cfg).shards:
            traces, sources = _sharded_traces(
                model.config, optimizers, cfg, batches, evaluation, device, world_size
            )
        else:
            traces, sources = traces_of(
                model.config, optimizers, cfg, batches, evaluation, device, cache, share, steps
            )
    for name in optimizers:
        if strategy_of(
            cfg
        ).shards:  # beside one rank's peaks, the shapes' totals are named as the whole model's
            for key in WHOLE_MODEL_KEYS:
                rows[name][f"whole_model_{key}"] = rows[name].pop(key)
        if step:
            trace = traces[name]
            if isinstance(trace, str):  # the reason FSDP refuses this optimizer: no figures
                rows[name]["unsupported"] = trace
                continue
            rows[name]["trace_source"] = sources[name]
            peak = trace.step_peak(warm_up=True)
            rows[name]["step_peak_bytes"] = peak["total"]
            rows[name]["step_peak"] = {f"{c}_bytes": peak[c] for c in CATEGORIES}
            # host memory, outside the step peak: activation offloading's copies (0 without it)
            rows[name]["step_peak_host_offloaded_bytes"] = peak.get(HOST_OFFLOADED, 0)
            rows[name]["run_peak_bytes"] = trace.run_peak["total"]
            rows[name]["run_peak"] = {f"{phase}_bytes": p["total"] for phase, p in trace.phases.items()}
            # why a figure is an upper bound rather than the step itself (None: the replay is the step)
            rows[name]["step_peak_bound"] = trace.step_peak_bound(warm_up=True)
            rows[name]["run_peak_bound"] = trace.bounds.get(trace.run_peak_phase)
            # what the run's step holds and the replay does not: said, never silently below
            rows[name]["step_peak_leaves_out"] = leaves_out(cfg, strategy_of(cfg).shards)
            rows[name]["flops_per_step"] = trace.flops
            # what the memory techniques repeat in backward, beside the model FLOPs (plan's lever cost)
            rows[name]["recomputed_flops_per_step"] = trace.recomputed_flops
    return rows


# Counted from the model's shapes: under FSDP what the whole model holds, not one rank
# (``estimate --json`` gives them as ``whole_model_<key>`` there, beside the rank's step peak).
WHOLE_MODEL_KEYS = ("weights_bytes", "grads_bytes", "optimizer_state_bytes", "total_bytes")


def counted_rows(model, optimizers: dict, cfg, batches: list[dict], evaluation: dict, device: str,
                 cache: bool = False) -> dict[str, dict]:  # fmt: skip
    """Each optimizer's figures counted from shapes (parameters, weights, gradients, optimizer state),
    kept in the trace cache with ``cache`` under its trace's key: building an optimizer imports its
    library (transformers' Adafactor imports peft and bitsandbytes, seconds), which a cached answer
    then does not."""
    from effitrain.memory import trace_cache

    def key_of(optimizer_cfg) -> dict:
        return {
            "counted": trace_cache.trace_key(model.config, optimizer_cfg, cfg, batches, evaluation, device)
        }

    rows = {}
    for name, optimizer_cfg in optimizers.items():
        key = key_of(optimizer_cfg) if cache else None
        rows[name] = trace_cache.read_figures(key) if key else None
        if rows[name] is None:
            rows[name] = _counted(model, optimizer_cfg, cfg)
            if key:
                trace_cache.write_figures(key, rows[name])
    return rows


def _counted(model, optimizer_cfg, cfg) -> dict:
    from effitrain.train.adapters.replay import unpacked_4bit_bytes
    from effitrain.train.optim import build_optimizer

    weights_bytes = params_footprint(model).bytes - unpacked_4bit_bytes(model.config, cfg)
    optimizer = build_optimizer(optimizer_cfg, model, cfg.weight_decay)
    grads, state = grads_estimate(optimizer), estimate_optimizer_state(optimizer)
    trainable = sum(p.numel() for p in optimizer_params(optimizer))
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "params_trainable": trainable,
        "vocab_size": getattr(model.config, "vocab_size", None),
        "weights_bytes": weights_bytes,
        "grads_bytes": grads.bytes,
        "optimizer_state_bytes": state.bytes if state else None,
        "optimizer_state_elements": state.elements if state else None,
        "optimizer_bytes_per_param": state.bytes / trainable if state and trainable else None,
        "total_bytes": weights_bytes + grads.bytes + state.bytes if state else None,
    }


def _sharded_traces(config, optimizers: dict, cfg, batches, evaluation, device: str, world_size: int):
    """One FSDP rank's trace per optimizer (or the line saying why FSDP refuses it), each a full
    replay of its own (:data:`effitrain.memory.trace_cache.TRACED_ALONE`)."""
    from effitrain.memory.sharded import UnshardableOptimizer, trace_sharded
    from effitrain.memory.trace_cache import TRACED_ALONE

    traces = {}
    for name, optimizer_cfg in optimizers.items():
        try:
            traces[name] = trace_sharded(
                config, optimizer_cfg, cfg, batches, device, evaluation, world_size=world_size
            )
        except UnshardableOptimizer as error:  # the other optimizers' rows still stand
            traces[name] = str(error)
    return traces, dict.fromkeys(optimizers, TRACED_ALONE)
