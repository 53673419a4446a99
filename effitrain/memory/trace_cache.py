"""Traces kept on disk by everything they depend on, so a second ``estimate`` or ``plan`` of the same
configuration answers at once.

    effitrain estimate model=distilbert_base_cased --device cuda            # traces, then keeps them
    effitrain estimate model=distilbert_base_cased --device cuda --no-cache # traces again

One file per optimizer's trace, ``<cache>/traces/<sha256 of its key>.json``, where ``<cache>`` is
``$EFFITRAIN_CACHE_DIR`` or ``~/.cache/effitrain``. The key holds the model's architecture, the
shapes replayed, precision, checkpointing, clipping, weight decay, the task, the adapter, the device profile, the
optimizer's node, the versions of the libraries whose kernels are replayed and the bytes of
effitrain's own code: a change to any of them is another file. The whole key is stored in the entry
and compared when read, so an entry that is corrupt or not this key's is traced again and rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from effitrain.memory.replay import Trace
from effitrain.util.atomic import write_atomic

# whose kernels and optimizers a trace replays: a new version may allocate otherwise
LIBRARIES = ("torch", "transformers", "accelerate", "bitsandbytes", "peft", "torchao", "lion-pytorch",
             "apollo-torch")  # fmt: skip

# how a trace was had, per optimizer (estimate's rows, plan's --json): a full replay of its own; the
# forward and backward shared with other optimizers, its step replayed; the same with its step's
# figures reused from an earlier candidate's identical step (effitrain.memory.shared_traces.StepReplays);
# read from the disk cache
TRACED_ALONE, TRACED_SHARED, STEP_REUSED, CACHED = "traced", "shared", "shared, step reused", "cached"


def cache_folder() -> Path:
    return Path(os.environ.get("EFFITRAIN_CACHE_DIR") or Path.home() / ".cache" / "effitrain") / "traces"


@functools.cache
def code_digest() -> str:
    """The SHA-256 of effitrain's own Python files: the replay's code, the step it runs, the
    builders it calls."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def library_versions() -> dict[str, str | None]:
    from importlib import metadata

    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def trace_key(config, optimizer_cfg, cfg, batches: list[dict], eval_shapes: dict | None, device: str) -> dict:
    """Everything a trace of ``optimizer_cfg`` depends on, as JSON-ready values."""
    from omegaconf import OmegaConf

    from effitrain.config.techniques import replay_keys
    from effitrain.util.compat import attention_implementation

    def node(value):
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value

    def shapes(batch):
        return {k: [list(v[0]), str(v[1])] if isinstance(v, tuple) else v for k, v in sorted(batch.items())}

    return {
        "model_config": config.to_dict(),
        "attention": attention_implementation(config),
        "optimizer": node(optimizer_cfg),
        "task": node(cfg.get("task")),
        "adapter": node(cfg.get("adapter")),
        "precision": node(cfg.precision),
        **replay_keys(cfg),  # each memory technique's entries: gradient_checkpointing's setting
        "max_grad_norm": cfg.max_grad_norm,
        "weight_decay": cfg.weight_decay,
        "batches": [shapes(b) for b in batches],
        "eval": shapes(eval_shapes) if eval_shapes is not None else None,
        "device": device,
        "libraries": library_versions(),
        "effitrain_code": code_digest(),
    }


def _path(key: dict) -> Path:
    text = json.dumps(key, sort_keys=True, default=str)
    return cache_folder() / f"{hashlib.sha256(text.encode()).hexdigest()}.json"


def _entry(key: dict) -> dict | None:
    """The cache's entry of ``key``; None where there is none, or it is unreadable or another key's."""
    try:
        entry = json.loads(_path(key).read_text())
        return entry if entry["key"] == json.loads(json.dumps(key, sort_keys=True, default=str)) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read(key: dict) -> Trace | None:
    """The cached trace of ``key``; None where there is none, or the entry is unreadable or another
    key's."""
    entry = _entry(key)
    try:
        if entry is None:
            return None
        return Trace(entry["phases"], entry["flops"], entry["bounds"], entry["recomputed_flops"])
    except (KeyError, TypeError):
        return None


def read_figures(key: dict) -> dict | None:
    """The figures :func:`write_figures` kept for ``key``; None as :func:`read`."""
    entry = _entry(key)
    figures = entry.get("figures") if entry is not None else None
    return figures if isinstance(figures, dict) else None


def write_figures(key: dict, figures: dict) -> None:
    """Keep ``figures`` (JSON values) under ``key``: what is computed beside a trace from the same
    inputs, such as ``estimate``'s counted bytes, whose optimizers take seconds to import."""
    write_atomic(_path(key), json.dumps({"key": key, "figures": figures}, default=str))


def write(key: dict, trace: Trace) -> None:
    entry = {"key": key, "phases": trace.phases, "flops": trace.flops, "bounds": trace.bounds,
             "recomputed_flops": trace.recomputed_flops}  # fmt: skip
    # phases in their order: a tie between two phases' totals goes to the first (Trace.run_peak_phase)
    write_atomic(_path(key), json.dumps(entry, default=str))


def traces_of(config, optimizer_cfgs: dict, cfg, batches: list[dict], eval_shapes: dict | None,
              device: str = "cpu", cache: bool = True, share: bool = True, steps=None) -> tuple[dict, dict]:  # fmt: skip
    """A :class:`Trace` per optimizer name, and how each was had (:data:`CACHED`, :data:`TRACED_SHARED`
    or :data:`TRACED_ALONE`). ``cache``: read and write the disk cache; ``share``: one replay of the
    forward and backward for every optimizer not cached (:func:`effitrain.memory.shared_traces.trace_runs`),
    else a full :func:`effitrain.memory.replay.trace_run` each, every micro-batch replayed, as effitrain
    did before."""
    from effitrain.config.techniques import OPTIMIZER_IN_BACKWARD
    from effitrain.memory import replay
    from effitrain.memory.shared_traces import trace_runs

    keys = {
        name: trace_key(config, node, cfg, batches, eval_shapes, device)
        for name, node in optimizer_cfgs.items()
    }
    traces, sources = {}, {}
    for name, key in keys.items():
        cached = read(key) if cache else None
        if cached is not None:
            traces[name], sources[name] = cached, CACHED
    missing = {name: node for name, node in optimizer_cfgs.items() if name not in traces}
    share = share and not OPTIMIZER_IN_BACKWARD.on(cfg)  # each update inside backward: nothing to share
    if share and missing:
        traces.update(trace_runs(config, missing, cfg, batches, device, eval_shapes, steps))
        reused = steps.reused if steps is not None else set()
        sources.update({name: STEP_REUSED if name in reused else TRACED_SHARED for name in missing})
    else:
        for name, node in missing.items():
            traces[name] = replay.trace_run(
                config, node, cfg, batches, device, eval_shapes, every_micro_batch=True
            )
            sources[name] = TRACED_ALONE
    if cache:
        for name in missing:
            write(keys[name], traces[name])
    return {name: traces[name] for name in optimizer_cfgs}, {name: sources[name] for name in optimizer_cfgs}
