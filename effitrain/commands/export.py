"""``effitrain export RUN [--out DIR]``: a finished run's final weights as a plain transformers model
folder (``config.json``, ``model.safetensors``, the tokenizer's files), which
``AutoModelFor...from_pretrained(DIR)`` loads with no effitrain installed.

What a user does with a result is use it elsewhere, and a checkpoint is not that: an adapter run
saves the adapter alone (its base is rebuilt), a sharded run saves each rank's shards in
``torch.distributed.checkpoint``'s files. Here the run's model is rebuilt as the run built it (from
the command line it was started with, ``.hydra/overrides.yaml``, composed and validated as ``check``
does, then compared with the config its checkpoint records), its final checkpoint loaded, an
adapter merged into its base (peft's ``merge_and_unload``), shards joined into one state dict, and
the whole written with transformers' ``save_pretrained``.

Nothing from the run folder runs code: ``summary.json`` and ``effitrain.json`` are JSON, the
overrides YAML read by the safe loader and checked as a command line is, the weights safetensors,
a sharded checkpoint read by :func:`effitrain.train.sharded_checkpoint.read_model_state`'s restricted
reader, every file's checksum verified first; a model whose code would come with it
(``model.trust_remote_code``) is refused. The folder appears whole or not at all
(:func:`effitrain.util.atomic.atomic_path`), never over an existing one, never through a link.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from effitrain.config.errors import ConfigError, invalid

PROVENANCE = "effitrain_export.json"  # what was exported: the run, its checkpoint, its eval/loss


def export(args) -> None:
    """``effitrain export``: ``args.run`` (a run folder) written as a model folder at ``args.out``
    (default ``<run>/export``). The cheap refusals come first, before anything heavy loads.

    Raises:
        ConfigError: one line: not a run, not ended ok, no final checkpoint, a config that cannot be
            rebuilt, an output folder that exists and is not empty or lies through a link.
    """
    run = Path(args.run)
    out = Path(args.out) if args.out else run / "export"
    summary = finished_summary(run)
    check_out(out, run)
    folder, meta = final_checkpoint(run, summary)
    cfg = run_config(run, meta)
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # a bar per weight file: the result is one line
    try:
        model, tokenizer, merged = rebuilt(cfg, folder, meta)
        provenance = {
            "run": str(run.resolve()),
            "checkpoint": folder.name,
            "step": meta["step"],
            "eval/loss": summary.get("eval/loss"),
            "adapter_merged": merged,
        }
        write(model, tokenizer, out, provenance)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    from effitrain.train.tasks import build_task

    auto = build_task(cfg).auto_class
    print(
        f"effitrain: exported {run} (step {meta['step']}, eval/loss {summary.get('eval/loss')}"
        f"{', adapter merged' if merged else ''}) -> {out}: {auto}.from_pretrained({str(out)!r})"
    )


def finished_summary(run: Path) -> dict:
    """The run's summary, which must say it ended ok.

    Raises:
        ConfigError: no run folder or summary; a run that failed, diverged or was interrupted.
    """
    from effitrain.run.results import SUMMARY, read_summary

    summary = read_summary(run) if run.is_dir() else None
    if summary is None:
        raise invalid("run", str(run), f"not a run folder (no readable {SUMMARY}): give the folder a run "
                      "wrote (its hydra.run.dir, or a job's folder of a sweep)")  # fmt: skip
    status = summary.get("status")
    if status != "ok":
        raise invalid("run", str(run), f"the run ended {status!r}, not 'ok': only a finished run is exported")
    return summary


def check_out(out: Path, run: Path) -> None:
    """``out`` is new (or an empty folder, so it holds no link either), and neither it nor a folder
    on its way inside the run folder is a link (:mod:`effitrain.util.links`: the run folder is anyone's
    to plant one in, and the default ``<run>/export`` lies there).

    Raises:
        ConfigError: it exists and is not empty (export never overwrites), or a link is on its way.
    """
    candidates = [out]
    absolute, inside = out.absolute(), run.absolute()
    if absolute.is_relative_to(inside):  # each folder between the run's and out: the run's to plant
        candidates += [p for p in absolute.parents if p.is_relative_to(inside) and p != inside]
    for path in candidates:
        if path.is_symlink():
            raise ConfigError(
                f"--out={str(out)!r} is invalid: {path} is a symbolic link (to {os.readlink(path)}), and "
                "effitrain writes through no link it did not make: remove the link, or give another folder"
            )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise invalid(
            "--out", str(out), "it exists and is not empty: export never overwrites; give a new folder"
        )


def final_checkpoint(run: Path, summary: dict) -> tuple[Path, dict]:
    """The run's newest checkpoint, whole (every file at its checksum, a sharded one plain data), of
    its last step: the weights the run's final evaluation saw.

    Raises:
        ConfigError: no checkpoint (``checkpoint_every`` was off), a damaged one, or one of an
            earlier step.
    """
    from effitrain.train.resume_point import examine, list_checkpoints

    found = list_checkpoints(run)
    if not found:
        raise invalid("run", str(run), "it saved no weights (checkpoint_every is off by default): rerun it "
                      "with checkpoint_every=N, which also saves the last step")  # fmt: skip
    step, folder = found[-1]
    meta, why = examine(folder)
    if meta is None:
        raise invalid("run", str(run), f"its last checkpoint {folder.name} is {why}")
    last = summary.get("train/steps", meta.get("num_steps"))
    if meta.get("step") != last or meta.get("num_steps") != last:
        raise invalid("run", str(run), f"its newest checkpoint is of step {meta.get('step')}, the run "
                      f"ended at step {last}: not the final weights")  # fmt: skip
    return folder, meta


def run_config(run: Path, meta: dict):
    """The run's config: its command line (``.hydra/overrides.yaml``) composed, validated and derived
    as the run's was, for the number of processes that wrote the checkpoint; then compared with the
    config the checkpoint records, key by key, so the model rebuilt is the one trained.

    Raises:
        ConfigError: no overrides file, a config that no longer composes or differs from the
            checkpoint's (conf/ changed since the run), a model whose code comes with it.
    """
    import yaml

    from effitrain.config.compose import compose_checked
    from effitrain.config.load import checked, derive
    from effitrain.config.record import first_difference, trajectory_config

    path = run / ".hydra" / "overrides.yaml"
    try:
        overrides = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        overrides = None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise invalid("run", str(run), f"no readable {path.relative_to(run)} (the run's command line, "
                      "which Hydra writes): export rebuilds the model from it")  # fmt: skip
    world_size = int(meta.get("world_size") or 1)
    try:
        cfg, problems = compose_checked(overrides)
        # before validation, which reads the model's config: with remote code, that code would run
        if cfg.model.get("trust_remote_code"):
            raise invalid("model.trust_remote_code", True, "export runs no code that comes with a model: "
                          "export a run of a model transformers builds itself")  # fmt: skip
        cfg = checked(cfg, problems, world_size, device="cuda")  # the run's machine's checks (fp16, paged)
    except ConfigError as error:
        first = str(error).splitlines()[0]
        raise invalid(
            "run", str(run), f"its command line does not make a config export can rebuild ({first})"
        ) from None
    derive(cfg, world_size)
    change = first_difference(trajectory_config(cfg), meta.get("config") or {})
    if change is not None:
        key, now, then = change
        raise invalid("run", str(run), f"its config cannot be rebuilt as it ran: {key} composes to "
                      f"{now!r} now, the checkpoint has {then!r} (conf/ changed since the run)")  # fmt: skip
    return cfg


def rebuilt(cfg, folder: Path, meta: dict):
    """(model, tokenizer, adapter merged): the run's model built as :func:`effitrain.run.build.build_job`
    builds it (the same seed before the model, so a randomly initialized frozen base is the same), on
    the CPU in the dtypes the run built it in, the checkpoint's weights loaded, an adapter merged into
    its base.

    A 4-bit base (``adapter=qlora``) is built as the run built it, then dequantized (transformers'
    ``dequantize``): each weight the value its 4-bit code stands for, which the run's layers computed
    with, so merged it is ``dequant(W) + (alpha / r) B A`` and no bitsandbytes is needed to load it."""
    import torch
    from safetensors.torch import load_model
    from transformers import set_seed

    from effitrain.train.adapters.build import apply_adapter
    from effitrain.train.adapters.configs import quantization_config
    from effitrain.train.adapters.files import load_adapter
    from effitrain.train.modeling import build_tokenizer
    from effitrain.train.sharded_checkpoint import METADATA, read_model_state
    from effitrain.train.tasks import build_task

    set_seed(cfg.seed)
    task = build_task(cfg)
    raw = task.load(cfg.data)  # a classifier's labels: the head's size and names
    tokenizer = build_tokenizer(cfg.model)
    task.collator(tokenizer)  # sets a decoder's padding token, as the run's did: the config records it
    set_seed(cfg.seed)
    quantization = quantization_config(cfg.get("adapter"), cfg.precision.mixed_precision)
    model = task.build_model(cfg.model, raw, tokenizer, quantization=quantization)
    if quantization is not None:
        model = model.dequantize(dtype=torch.float32)
    model = apply_adapter(model, cfg.get("adapter"), task)
    files = meta["files"]
    merged = load_adapter(model, folder, "cpu")
    if merged:
        model = model.merge_and_unload()
    elif "model.safetensors" in files:
        load_model(model, str(folder / "model.safetensors"), strict=True, device="cpu")
    elif METADATA in files:
        model.load_state_dict(read_model_state(folder), strict=True)
    else:
        raise invalid("run", str(folder.parent.parent), f"{folder.name} holds no weights export can read")
    return model.eval(), tokenizer, merged


def write(model, tokenizer, out: Path, provenance: dict) -> None:
    """The model folder, assembled under a hidden name beside ``out`` and renamed into place whole;
    files readable as any other new file (safetensors writes 0600).

    Raises:
        ConfigError: it cannot be written (nothing of it is left).
    """
    from effitrain.train.checkpoint import _umask
    from effitrain.util.atomic import atomic_path

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
            for path in tmp.iterdir():
                os.chmod(path, 0o666 & ~_umask())
    except OSError as error:
        raise invalid("--out", str(out), f"cannot be written ({error.strerror or error})") from None
