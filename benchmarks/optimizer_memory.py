"""Optimizer state, measured after one real step and estimated from shapes, for every optimizer.

    python benchmarks/optimizer_memory.py                       # minilm and distilbert_base_cased
    python benchmarks/optimizer_memory.py model=tiny            # any one model (Hydra overrides)

For each model: the estimate comes from a ``meta`` model (``effitrain.commands.estimate.estimate_memory``, what
``effitrain estimate`` prints); the measurement builds the real model on this machine's device, runs
one forward/backward/optimizer step on a 4 x 16-token batch, and counts the distinct storages in
``optimizer.state`` (``effitrain.memory.optimizer_state_footprint``). Bytes are exact integers.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from effitrain import memory
from effitrain.commands.estimate import estimate_memory
from effitrain.config.compose import compose
from effitrain.config.registry import group_options
from effitrain.train.modeling import build_model, build_tokenizer
from effitrain.train.optim import build_optimizer

MODELS = {
    "minilm": ["model=minilm"],
    # offline the run pairs the architecture with MiniLM's tokenizer: size the estimate's vocabulary alike
    "distilbert_base_cased": [
        "model=distilbert_base_cased",
        "model.init=random",
        "model.architecture.vocab_size=30522",
    ],
}
COMMON = ["data=synthetic"]  # 3 labels, as the default data; nothing is read


def measure(overrides: list[str]) -> dict:
    cfg = compose(overrides)
    names = group_options("optimizer")
    optimizer_cfgs = {name: compose(overrides + [f"optimizer={name}"]).optimizer for name in names}
    estimates = estimate_memory(cfg, optimizer_cfgs, step=False)
    tokenizer = build_tokenizer(cfg.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data.num_labels, tokenizer).to(device)
    batch = {
        "input_ids": torch.randint(1000, 2000, (4, 16), device=device),
        "labels": torch.tensor([0, 1, 2, 0], device=device),
    }
    rows = {}
    for name in names:
        optimizer = build_optimizer(optimizer_cfgs[name], model, cfg.weight_decay)
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        measured = memory.optimizer_state_footprint(optimizer)
        rows[name] = {"measured": measured, "estimate": estimates[name]}
        del optimizer
    return rows


def main():
    args = sys.argv[1:]
    models = {" ".join(args): args} if args else MODELS
    print(
        f"{'model':<22}{'optimizer':<11}{'params':>12}{'measured B':>13}{'estimated B':>13}"
        f"{'equal':>7}{'B/param':>9}{'x AdamW':>9}"
    )
    for label, overrides in models.items():
        rows = measure(COMMON + overrides)
        adamw = rows["adamw"]["measured"].bytes if "adamw" in rows else None
        for name, row in rows.items():
            measured, estimate = row["measured"], row["estimate"]
            params = estimate["params_trainable"]
            ratio = f"{measured.bytes / adamw:9.4f}" if adamw else f"{'':>9}"
            print(
                f"{label:<22}{name:<11}{params:>12,}{measured.bytes:>13,}{estimate['optimizer_state_bytes']:>13,}"
                f"{measured.bytes == estimate['optimizer_state_bytes']!s:>7}"
                f"{measured.bytes / params:>9.4f}{ratio}"
            )


if __name__ == "__main__":
    main()
