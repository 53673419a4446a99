"""The CUDA prediction against what an NVIDIA H100 measured (tests/data/h100-step-peak.md),
from this machine, whatever it is: no GPU is used.

    python benchmarks/h100_reference.py

For each published row (distilbert, model.init=random, vocabulary 30,522, 16 x 128 tokens, fp32):
the H100's MemTracker figures per category, the step replayed with ``--device cuda`` as it was
measured (every text 128 tokens, so no attention mask), and what ``effitrain estimate --device cuda``
prints (its worst case assumes padding, so each layer also keeps a mask), then the old CPU replay.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from effitrain.commands.estimate import estimate_memory  # noqa: E402
from effitrain.config.compose import compose  # noqa: E402
from effitrain.memory import MIB  # noqa: E402
from effitrain.memory.replay import trace_step  # noqa: E402
from effitrain.memory.step_peak import CATEGORIES  # noqa: E402
from effitrain.train.modeling import build_model  # noqa: E402
from effitrain.train.tasks import build_task  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "h100-step-peak.md"
DISTILBERT = ["model=distilbert_base_cased", "model.init=random", "model.architecture.vocab_size=30522",
              "max_length=128", "micro_batch_size=16", "data=synthetic"]  # fmt: skip


def published() -> dict:
    text = REFERENCE.read_text()
    rows = re.findall(r"^\| (\w+) \| (\d+) \| (true|false) \|", text, re.M)
    values = [float(v) for v in re.findall(r"\| \*{0,2}([\d.]+)\*{0,2} \| [\d.]+ \|$", text, re.M)]
    return {(o, c == "true"): values[i * 6 : i * 6 + 6] for i, (o, _, c) in enumerate(rows)}


def main() -> None:
    measured = published()
    print("optimizer | recompute | " + " | ".join(CATEGORIES) + " | step peak | largest |replayed - H100| "
          "of a category, MiB | step peak replayed / H100  (MiB: H100 / replayed as measured / estimate's worst case)")  # fmt: skip
    for checkpointing in (False, True):
        cfg = compose([*DISTILBERT, f"gradient_checkpointing={checkpointing}"])
        task = build_task(cfg)
        model = build_model(cfg.model, 3, None, device="meta", auto_class=task.auto_class)
        tokens = ((16, 128), torch.int64)
        batch = {
            "input_ids": tokens,
            "attention_mask": tokens,
            "labels": ((16,), torch.int64),
            "padded": False,
        }
        optimizers = {o: compose([f"optimizer={o}"]).optimizer for o in ("adafactor", "adam8bit", "adamw")}
        worst = estimate_memory(cfg, optimizers, device="cuda")
        for name, optimizer_cfg in optimizers.items():
            peak, _ = trace_step(model.config, optimizer_cfg, cfg, [batch], True, device="cuda")
            replayed = [peak[c] / MIB for c in CATEGORIES] + [peak["total"] / MIB]
            estimate = [worst[name]["step_peak"][f"{c}_bytes"] / MIB for c in CATEGORIES]
            estimate.append(worst[name]["step_peak_bytes"] / MIB)
            h100 = measured[(name, checkpointing)]
            cells = [f"{m:.1f} / {r:.1f} / {e:.1f}" for m, r, e in zip(h100, replayed, estimate)]
            error = max(abs(r - m) for m, r in zip(h100[:-1], replayed[:-1]))
            print(f"{name} | {str(checkpointing).lower()} | " + " | ".join(cells)
                  + f" | {error:.1f} | {replayed[-1] / h100[-1]:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
