"""Framework overhead: effitrain's backends against hand-written equivalents, on the same work.

    python benchmarks/overhead.py                       # minilm, 24 steps, 3 interleaved rounds
    python benchmarks/overhead.py --rounds 5 --steps 40 model=tiny

Four loops train the same model, data, optimizer and number of steps, in this one process, in
interleaved rounds (A B C D, A B C D, ...), so a busy machine slows all of them alike:

* ``effitrain accelerator``: ``effitrain.run.recipe.run`` with ``backend=accelerator`` (meter, memory
  tracking, metrics file and all);
* ``plain torch loop``: forward, cross-entropy, backward, clip, step, schedule, zero_grad;
* ``effitrain trainer``: ``run`` with ``backend=trainer``;
* ``plain Trainer``: ``transformers.Trainer`` given the same model, data, optimizer and schedule.

Each loop is timed from its first batch to the end of its last optimizer step (the Trainers' from
the call to ``train()``, where effitrain's meter starts); the ratio is effitrain's time over the hand-written loop's, median over rounds.
Data is generated with equal-length texts, so any sample order gives the same tensor shapes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from itertools import pairwise
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F

from effitrain.config.compose import compose
from effitrain.run.recipe import build_job, run

BASE = [
    "data=synthetic",
    "data.num_train=2048",
    "data.words_per_text=40",
    "micro_batch_size=16",
    "progress_bar=false",
    "logger=none",
    "lr_scheduler=constant",
]


def effitrain_loop(overrides, backend):
    with tempfile.TemporaryDirectory() as folder:
        summary = run(compose(overrides + [f"backend={backend}"]), folder)
    assert summary["status"] == "ok", summary["error"]
    return summary["speed/train_s"], summary["speed/step_s_median"]


def _job(overrides):
    from accelerate import PartialState
    from transformers import set_seed

    cfg = compose(overrides)
    job = build_job(cfg, Path(tempfile.mkdtemp()), [], PartialState().device, True)
    set_seed(cfg.seed)
    return cfg, job


def plain_torch_loop(overrides):
    cfg, job = _job(overrides)
    model, optimizer, scheduler = job.model, job.optimizer, job.scheduler
    model.train()
    times, step = [], 0
    start = last = time.perf_counter()
    for batch in job.train_loader:
        labels = batch.pop("labels")
        loss = F.cross_entropy(model(**batch).logits, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # a loop that reports its loss reads it once per step
        now = time.perf_counter()
        times.append(now - last)
        last, step = now, step + 1
        if step == job.num_steps:
            break
    return last - start, statistics.median(times[2:])


def plain_trainer(overrides):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cfg, job = _job(overrides)
    times = []

    class Clock(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter())

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=cfg.micro_batch_size,
        max_steps=job.num_steps,
        max_grad_norm=cfg.max_grad_norm,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=cfg.seed,
    )
    trainer = Trainer(
        model=job.model,
        args=args,
        train_dataset=job.train_loader.dataset,
        data_collator=job.train_loader.collate_fn,
        optimizers=(job.optimizer, job.scheduler),
        callbacks=[Clock()],
    )
    times.append(time.perf_counter())  # from train(), as effitrain's meter starts before trainer.train()
    trainer.train()
    steps = [b - a for a, b in pairwise(times)]
    return times[-1] - times[0], statistics.median(steps[2:])


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (default model: minilm)")
    args = parser.parse_args()
    overrides = BASE + [f"max_steps={args.steps}"] + args.overrides
    loops = {
        "effitrain accelerator": lambda: effitrain_loop(overrides, "accelerator"),
        "plain torch loop": lambda: plain_torch_loop(overrides),
        "effitrain trainer": lambda: effitrain_loop(overrides, "trainer"),
        "plain Trainer": lambda: plain_trainer(overrides),
    }
    results = {name: [] for name in loops}
    for round_ in range(args.rounds):
        for name, loop in loops.items():
            results[name].append(loop())
            total, median = results[name][-1]
            print(
                f"round {round_ + 1}: {name:<22} train {total:7.3f} s  median step {median * 1000:7.1f} ms",
                flush=True,
            )
    total = {name: statistics.median(t for t, _ in runs) for name, runs in results.items()}
    step = {name: statistics.median(m for _, m in runs) for name, runs in results.items()}
    print(f"\noverrides: {' '.join(overrides)}; torch threads {torch.get_num_threads()}")
    print(f"{'loop':<24}{'train s (median)':>18}{'step ms (median)':>18}")
    for name in loops:
        print(f"{name:<24}{total[name]:>18.3f}{step[name] * 1000:>18.1f}")
    for ours, plain in (
        ("effitrain accelerator", "plain torch loop"),
        ("effitrain trainer", "plain Trainer"),
    ):
        print(
            f"ratio {ours} / {plain}: train time {total[ours] / total[plain]:.3f}, "
            f"median step {step[ours] / step[plain]:.3f}  (target <= 1.02)"
        )


if __name__ == "__main__":
    main()
