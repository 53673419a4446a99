"""Predicted vs measured step peak, per category, for model x optimizer x micro batch; and how long
an estimate takes.

    python benchmarks/memory_prediction.py                         # tiny and minilm, CPU here
    python benchmarks/memory_prediction.py --models distilbert_base_cased --micro 16 32   # on a GPU

Each combination is one real run of two optimizer steps in a process of its own (logger=none,
synthetic data padded to a fixed length, so the tracked step is the worst case the estimate
assumes): an allocator's peaks never carry from one row into the next. Printed: the measured
step peak by category (MemTracker on the real step), the prediction (the same step replayed on
fake tensors), their ratio, and on CUDA the allocator's max_memory_allocated for the same run,
against which the prediction's ratio is printed too. Then the seconds `effitrain estimate` takes
for each model (every optimizer of conf/optimizer, at --max-length), and what tracking costs: the
tracked step's time against the median step of the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from effitrain.commands.estimate import estimate_memory  # noqa: E402
from effitrain.config.compose import compose  # noqa: E402
from effitrain.config.registry import group_options  # noqa: E402
from effitrain.memory import MIB  # noqa: E402
from effitrain.memory.step_peak import CATEGORIES  # noqa: E402
from effitrain.run.isolated import run_isolated  # noqa: E402

MODEL = {"distilbert_base_cased": ["model.init=random"]}


def run_once(model: str, micro: int, max_length: int, steps: int, *overrides: str) -> dict:
    """One real run, in its own process, on synthetic texts longer than ``max_length`` (every
    micro-batch the worst case)."""
    return run_isolated([f"model={model}", *MODEL.get(model, []), "data=synthetic", f"max_length={max_length}",
                         f"data.words_per_text={max_length * 2}", f"micro_batch_size={micro}",
                         f"max_steps={steps}", *overrides])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "minilm"])
    parser.add_argument("--optimizers", nargs="+", default=group_options("optimizer"))
    parser.add_argument("--micro", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument(
        "--checkpointing",
        nargs="+",
        default=["false"],
        choices=["false", "true"],
        help="gradient_checkpointing settings to run (default: false)",
    )
    parser.add_argument("--tracking-steps", type=int, default=12, help="steps of the tracking-cost runs")
    parser.add_argument("--tracking-repeats", type=int, default=3, help="tracking-cost runs per combination")
    args = parser.parse_args()
    print("model | optimizer | micro | recompute | " + " | ".join(CATEGORIES) + " | step peak MiB | predicted MiB | "
          "predicted / measured | cuda max allocated MiB | predicted / cuda")  # fmt: skip
    combinations = [(m, o, b, c) for m in args.models for o in args.optimizers for c in args.checkpointing
                    for b in args.micro]  # fmt: skip
    for model, optimizer, micro, checkpointing in combinations:
        row = f"{model} | {optimizer} | {micro} | {checkpointing}"
        s = run_once(model, micro, args.max_length, 2, f"optimizer={optimizer}",
                     f"gradient_checkpointing={checkpointing}")  # fmt: skip
        if s["status"] != "ok":
            print(f"{row} | {s['status']}: {s['error']}")
            continue
        measured, predicted = s["mem/step_peak_bytes"], s.get("mem/step_peak_bytes_predicted")
        cuda = s.get("mem/cuda_max_allocated_bytes")
        parts = " | ".join(
            f"{s[f'mem/step_peak/{c}_bytes'] / MIB:.1f} / {s.get(f'mem/step_peak_predicted/{c}_bytes', 0) / MIB:.1f}"
            for c in CATEGORIES
        )
        print(f"{row} | {parts} | {measured / MIB:.1f} | "
              f"{predicted / MIB:.1f} | {predicted / measured:.4f} | "
              f"{cuda / MIB if cuda else float('nan'):.1f} | {predicted / cuda if cuda else float('nan'):.3f}")  # fmt: skip
    print("\nmodel | seconds for `effitrain estimate` (all optimizers)")
    for model in args.models:
        cfg = compose([f"model={model}", *MODEL.get(model, []), f"max_length={args.max_length}",
                                  "data=synthetic"])  # fmt: skip
        optimizers = {name: compose([f"model={model}", f"optimizer={name}"]).optimizer
                      for name in args.optimizers}  # fmt: skip
        started = time.perf_counter()
        estimate_memory(cfg, optimizers)
        print(f"{model} | {time.perf_counter() - started:.1f}")
    print(f"\nmodel | micro | tracked / median step, each of {args.tracking_repeats} runs of {args.tracking_steps} "
          "steps (AdamW) | median step s")  # fmt: skip
    for model in args.models:
        for micro in args.micro:
            ratios, medians = [], []
            for _ in range(args.tracking_repeats):
                s = run_once(model, micro, args.max_length, args.tracking_steps, "optimizer=adamw")
                if s["status"] != "ok":
                    raise SystemExit(f"{model} | {micro} | {s['status']}: {s['error']}")
                ratios.append(s["speed/tracked_step_s"] / s["speed/step_s_median"])
                medians.append(s["speed/step_s_median"])
            print(
                f"{model} | {micro} | {' '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(medians):.3f}"
            )


if __name__ == "__main__":
    main()
