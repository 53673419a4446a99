"""Shared test helpers: compose the real config (shrunk to a tiny model on generated data) and run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Small and fast: a 2-layer BERT with 32 hidden units on 256 generated samples.
TINY = [
    "model=tiny",
    "data=synthetic",
    "epochs=1",
    "micro_batch_size=8",
    "eval_batch_size=32",
    "progress_bar=false",
    "logger=none",
]

# The CUDA profile's hardest replay: a causal Llama in bf16 autocast with its layers recomputed.
CAUSAL_BF16_CHECKPOINTING = [
    "task=causal_lm",
    "model=llama_tiny",
    "max_length=64",
    "precision=bf16",
    "gradient_checkpointing=true",
]


# (overrides, working directory) -> a config composed earlier in this process (compose below)
_COMPOSED: dict = {}


def compose(*overrides: str, tiny: bool = True):
    """The config train.py would compose (Hydra's own compose API), HydraConfig set as in a run.

    Composed once per test process for the same overrides and working directory (Hydra's
    ``runtime.cwd``), each call given its own copy (a deep copy is some milliseconds, a composition
    a tenth of a second), since many tests compose the same overrides."""
    import copy

    from hydra.core.hydra_config import HydraConfig

    from effitrain.config.compose import compose

    key = (tuple((TINY if tiny else []) + list(overrides)), os.getcwd())
    if key not in _COMPOSED:
        cfg = compose(list(key[0]))
        _COMPOSED[key] = copy.deepcopy(cfg)
        return cfg
    cfg = copy.deepcopy(_COMPOSED[key])
    HydraConfig.instance().set_config(cfg)  # as composing sets it
    return cfg


def run_job(tmp_path: Path, *overrides: str, tiny: bool = True) -> dict:
    """One run in this process; returns its summary (also written to tmp_path/summary.json)."""
    from effitrain.run.recipe import run

    return run(compose(*overrides, tiny=tiny), tmp_path)


def read_metrics(folder: Path, kind: str = "train") -> list[dict]:
    """metrics.jsonl's lines: the optimizer steps' (``train``), the evaluations' (``eval``) or ``all``."""
    lines = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    if kind == "all":
        return lines
    return [line for line in lines if ("train/loss" in line) == (kind == "train")]


def wait_for_lines(process: subprocess.Popen, text: str, count: int, timeout: float = 300) -> list[str]:
    """stdout lines of ``process`` up to the ``count``-th holding ``text`` (it must still run)."""
    lines, deadline = [], time.time() + timeout
    while sum(text in line for line in lines) < count:
        assert time.time() < deadline and process.poll() is None, "".join(lines)
        lines.append(process.stdout.readline())
    return lines


def train_py(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600):
    """``python train.py ARGS`` in a subprocess, as a user types it."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class ParamSnapshots:
    """A metric logger that also copies the model's parameters at every optimizer step."""

    def __init__(self):
        self.model = None
        self.lines: list[dict] = []
        self.params: list[dict] = []

    def log_dict(self, payload: dict, step: int) -> None:
        self.lines.append(dict(payload))
        self.params.append({n: p.detach().clone() for n, p in self.model.named_parameters()})

    def close(self) -> None:
        pass


def fit(job) -> dict:
    """Train (the backend's loop), then evaluate, as a run does between them: the train and eval metrics."""
    from effitrain.run.recipe import evaluate_job, train

    metrics, evaluation = train(job)
    metrics.update(evaluate_job(job, evaluation))
    return metrics


def fit_with_snapshots(tmp_path: Path, *overrides: str):
    """Build a job as ``run`` does and fit it, recording parameters after each optimizer step.

    Returns (snapshots, metrics from fit, the job).
    """
    from effitrain.config.validate import validate
    from effitrain.run.build import build_job
    from effitrain.train.distributed import process_state

    cfg = compose(*overrides)
    validate(cfg)
    state = process_state()
    snapshots = ParamSnapshots()
    job = build_job(cfg, Path(tmp_path), [snapshots], state.device, True)
    snapshots.model = job.model
    metrics = fit(job)
    return snapshots, metrics, job


def optimizer_option(name: str):
    """An option of conf/optimizer as a test parameter, skipped where its optional package (an
    extra such as torchao) is not installed."""
    from omegaconf import OmegaConf

    from effitrain.config.registry import CONF_DIR, install_hint, missing_module

    missing = missing_module(OmegaConf.load(CONF_DIR / "optimizer" / f"{name}.yaml"))
    reason = f"{missing} is not installed ({install_hint(missing)})" if missing else ""
    return pytest.param(name, marks=pytest.mark.skipif(missing is not None, reason=reason))


def final_weights(run_dir: Path) -> dict:
    """The last checkpoint's whole weights: its model.safetensors, or under parallel=fsdp the ranks'
    torch.distributed.checkpoint shards joined."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    [folder] = sorted(Path(run_dir).glob("checkpoints/step-*"))[-1:]
    if (folder / "model.safetensors").exists():
        return load_file(folder / "model.safetensors")
    dcp_to_torch_save(folder, Path(run_dir) / "joined.pt")
    return torch.load(Path(run_dir) / "joined.pt", weights_only=True)["model"]


def relative_difference(a: dict, b: dict, names=None) -> float:
    """||a - b|| / ||a|| over the named tensors (default: all of ``a``'s) taken as one vector."""
    import torch

    names = sorted(a) if names is None else list(names)
    flat_a = torch.cat([a[n].flatten().double() for n in names])
    flat_b = torch.cat([b[n].flatten().double() for n in names])
    return ((flat_a - flat_b).norm() / flat_a.norm()).item()
