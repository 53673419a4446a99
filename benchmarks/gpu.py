"""Everything only a GPU shows, in one command: the CUDA memory prediction against the GPU's own
figures, 8-bit Adam's saving, compile's speed-up on both backends, MFU, and each memory lever's
device bytes, host copies and step time (activation offloading, chunked cross-entropy, the step in
backward, with and without checkpointing).

    python benchmarks/gpu.py --out gpu-results              # on a CUDA machine (301 s on one H200, --jobs 8)
    python benchmarks/gpu.py --out gpu-results --dry-run    # anywhere: every case composes and is valid

Each case is one real run (``effitrain train``, logger off, synthetic data, no network) in a process
of its own, so no allocator peak carries from one case into the next. Memory cases (distilbert with
``model.init=random`` and llama_small, each optimizer, gradient checkpointing off/on, fp32 and bf16,
16 x 128 tokens, every text longer than max_length), and LoRA and QLoRA on both models (AdamW, bf16;
the optimizer cell reads ``adamw + lora``), run ``--jobs`` at a time: each process has its own
allocator statistics. Timing cases (compile off/on for both backends) run one at a time, alone.

Written to ``--out``: ``gpu.json`` (every figure, bytes) and ``gpu.md`` (the tables). Per memory
case: the step peak MemTracker measured on the GPU's tensors and the one the run predicted for CUDA
(``--device cuda``'s replay), per category; the run's predicted peak (its largest phase) against
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the whole run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MIB = 2**20
CATEGORIES = ["weights", "gradients", "optimizer_state", "activations", "temporaries"]
MAX_LENGTH, MICRO = 128, 16
COMMON = ["data=synthetic", f"max_length={MAX_LENGTH}", f"data.words_per_text={2 * MAX_LENGTH}",
          f"micro_batch_size={MICRO}"]  # fmt: skip
MODELS = {
    "distilbert_base_cased": ["model=distilbert_base_cased", "model.init=random",
                              "model.architecture.vocab_size=30522"],
    "llama_small": ["task=causal_lm", "model=llama_small"],
}  # fmt: skip
OPTIMIZERS = ["adamw", "adafactor", "adam8bit"]
TIMING_MODEL = "llama_small"
TIMING_STEPS = 30
# one FSDP rank's figures: what it holds (on the CPU with offload) and what the GPU allocated
FSDP_KEYS = [
    "params_bytes",
    "grads_bytes",
    "optimizer_state_bytes",
    "step_peak_bytes",
    "cuda_max_allocated_bytes",
]


def memory_cases(optimizers: list[str]) -> list[dict]:
    return [
        {"model": model, "optimizer": optimizer, "checkpointing": checkpointing, "precision": precision,
         "overrides": [*MODELS[model], *COMMON, f"optimizer={optimizer}", f"precision={precision}",
                       f"gradient_checkpointing={str(checkpointing).lower()}", "max_steps=4"]}
        for model in MODELS for optimizer in optimizers for checkpointing in (False, True)
        for precision in ("fp32", "bf16")
    ]  # fmt: skip


def adapter_cases() -> list[dict]:
    """LoRA and QLoRA (4-bit NF4 base: bitsandbytes' CUDA kernels) on both models, AdamW, bf16."""
    return [
        {"model": model, "optimizer": "adamw", "checkpointing": False, "precision": "bf16", "adapter": adapter,
         "overrides": [*MODELS[model], *COMMON, "optimizer=adamw", "precision=bf16", f"adapter={adapter}",
                       "max_steps=4"]}
        for model in MODELS for adapter in ("lora", "qlora")
    ]  # fmt: skip


def timing_cases() -> list[dict]:
    return [
        {"backend": backend, "compile": compile_,
         "overrides": [*MODELS[TIMING_MODEL], *COMMON, "optimizer=adamw", "precision=bf16", f"backend={backend}",
                       f"compile={compile_}", f"max_steps={TIMING_STEPS}"]}
        for backend in ("accelerator", "trainer") for compile_ in ("off", "on")
    ]  # fmt: skip


def fsdp_cases() -> list[dict]:
    """One rank of FSDP2 (a group of one: nothing split), CPU offload off and on: what one GPU can
    show of sharding. The per-rank split itself needs several GPUs: ``torchrun --nproc_per_node N
    train.py parallel=fsdp`` there, each rank's figures in summary_ranks.json."""
    return [
        {"offload": offload,
         "overrides": [*MODELS[TIMING_MODEL], *COMMON, "optimizer=adamw", "precision=bf16", "parallel=fsdp",
                       f"parallel.offload={str(offload).lower()}", "max_steps=4"]}
        for offload in (False, True)
    ]  # fmt: skip


# Each memory lever (docs/levers.md) beside none; the step in backward takes no clipping
LEVERS = {
    "none": [],
    "activation_offloading": ["activation_offloading=true"],
    "loss_chunks": ["loss_chunks=8"],
    "optimizer_in_backward": ["optimizer_in_backward=true", "max_grad_norm=0"],
}


def offloading_cases() -> list[dict]:
    """Each memory lever, with and without checkpointing: activation offloading (pinned host memory,
    copied on a side stream), chunked cross-entropy, the step in backward; the device's bytes, the
    host's copies and the step time, one case at a time."""
    return [
        {"lever": lever, "checkpointing": checkpointing,
         "overrides": [*MODELS[TIMING_MODEL], *COMMON, "optimizer=adamw", "precision=bf16",
                       f"gradient_checkpointing={str(checkpointing).lower()}", *LEVERS[lever],
                       f"max_steps={TIMING_STEPS}"]}
        for checkpointing in (False, True) for lever in LEVERS
    ]  # fmt: skip


OFFLOADING_KEYS = {  # row key -> summary key
    "step_peak_measured_bytes": "mem/step_peak_bytes",
    "step_peak_predicted_bytes": "mem/step_peak_bytes_predicted",
    "activations_measured_bytes": "mem/step_peak/activations_bytes",
    "activations_predicted_bytes": "mem/step_peak_predicted/activations_bytes",
    "host_offloaded_measured_bytes": "mem/step_peak/host_offloaded_bytes",
    "host_offloaded_predicted_bytes": "mem/step_peak_predicted/host_offloaded_bytes",
    "cuda_max_allocated_bytes": "mem/cuda_max_allocated_bytes",
}


def dry_run(cases: list[dict]) -> None:
    """Compose and validate every case as ``effitrain check`` does; nothing is built or run."""
    from effitrain.commands.train_command import preflight
    from effitrain.config.errors import ConfigError

    bad = 0
    for case in cases:
        try:
            preflight([*case["overrides"], "logger=none"])
        except ConfigError as error:
            bad += 1
            print(f"invalid: {' '.join(case['overrides'])}: {error}")
    print(f"gpu.py --dry-run: {len(cases) - bad} of {len(cases)} cases compose and are valid")
    if bad:
        raise SystemExit(1)


def memory_row(case: dict, summary: dict) -> dict:
    row = {k: case[k] for k in ("model", "optimizer", "checkpointing", "precision")}
    row["adapter"] = case.get("adapter", "none")
    row["status"] = summary["status"]
    if summary["status"] != "ok":
        row["error"] = summary.get("error")
        return row
    for suffix, key in (("", "measured"), ("_predicted", "predicted")):
        row[f"step_peak_{key}_bytes"] = summary.get(f"mem/step_peak_bytes{suffix}")
        row[f"step_peak_{key}"] = {c: summary.get(f"mem/step_peak{suffix}/{c}_bytes") for c in CATEGORIES}
    row["step_peak_predicted_error"] = summary.get("mem/step_peak_predicted_error")
    row["run_peak_predicted_bytes"] = summary.get("mem/run_peak_bytes_predicted")
    row["run_peak_predicted"] = {
        key.rsplit("/", 1)[1].removesuffix("_bytes"): value
        for key, value in summary.items()
        if key.startswith("mem/run_peak_predicted/")
    }
    row["cuda_max_allocated_bytes"] = summary.get("mem/cuda_max_allocated_bytes")
    row["cuda_max_reserved_bytes"] = summary.get("mem/cuda_max_reserved_bytes")
    row["params_trainable"] = summary.get("params/trainable")
    row["optimizer_bytes_per_param"] = summary.get("mem/optimizer_bytes_per_param")
    row["mfu"] = summary.get("speed/mfu")
    return row


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(value, scale=1.0, digits=1):
    return "" if value is None else f"{value / scale:.{digits}f}"


def eight_bit_savings(rows: list[dict]) -> list[dict]:
    """AdamW's step peak minus 8-bit Adam's, per trainable parameter, measured and predicted."""
    by_key = {
        (r["model"], r["optimizer"], r["checkpointing"], r["precision"]): r
        for r in rows
        if r["status"] == "ok" and r.get("adapter", "none") == "none"
    }
    savings = []
    for (model, optimizer, checkpointing, precision), adamw in by_key.items():
        eight = by_key.get((model, "adam8bit", checkpointing, precision))
        if optimizer != "adamw" or eight is None:
            continue
        params = adamw["params_trainable"]
        savings.append({
            "model": model, "checkpointing": checkpointing, "precision": precision,
            "measured_bytes_per_param": (adamw["step_peak_measured_bytes"] - eight["step_peak_measured_bytes"]) / params,
            "predicted_bytes_per_param": (adamw["step_peak_predicted_bytes"] - eight["step_peak_predicted_bytes"]) / params,
        })  # fmt: skip
    return savings


def markdown(result: dict) -> str:
    lines = [f"# GPU results: {result['device']}", "", f"torch {result['torch']}, "
             + ", ".join(f"{name} {v}" for name, v in result.get("libraries", {}).items())
             + f"; written by `{result['command']}`; "
             f"{result['seconds']:.0f} s.", "", "## Step peak: predicted for CUDA / measured by MemTracker (MiB)", "",
             "| model | optimizer | recompute | precision | " + " | ".join(CATEGORIES)
             + " | step peak | predicted / measured | run peak predicted | max allocated | max reserved | "
             "allocated / run peak predicted |",
             "|---|---|---|---|" + "---:|" * (len(CATEGORIES) + 6)]  # fmt: skip
    for row in result["memory"]:
        adapter = row.get("adapter", "none")
        optimizer = row["optimizer"] if adapter == "none" else f"{row['optimizer']} + {adapter}"
        head = f"| {row['model']} | {optimizer} | {str(row['checkpointing']).lower()} | {row['precision']} |"
        if row["status"] != "ok":
            lines.append(f"{head} {row['status']}: {row.get('error')} |")
            continue
        cells = [
            f"{fmt(row['step_peak_predicted'][c], MIB)} / {fmt(row['step_peak_measured'][c], MIB)}"
            for c in CATEGORIES
        ]
        peak = f"{fmt(row['step_peak_predicted_bytes'], MIB)} / {fmt(row['step_peak_measured_bytes'], MIB)}"
        lines.append(
            f"{head} {' | '.join(cells)} | {peak} | "
            f"{fmt(ratio(row['step_peak_predicted_bytes'], row['step_peak_measured_bytes']), digits=4)} | "
            f"{fmt(row['run_peak_predicted_bytes'], MIB)} | {fmt(row['cuda_max_allocated_bytes'], MIB)} | "
            f"{fmt(row['cuda_max_reserved_bytes'], MIB)} | "
            f"{fmt(ratio(row['cuda_max_allocated_bytes'], row['run_peak_predicted_bytes']), digits=3)} |"
        )  # fmt: skip
    lines += ["", "## 8-bit Adam's saving over AdamW at the step peak (bytes per trainable parameter)", "",
              "| model | recompute | precision | measured | predicted |", "|---|---|---|---:|---:|"]  # fmt: skip
    for s in result["adam8bit_saving"]:
        lines.append(f"| {s['model']} | {str(s['checkpointing']).lower()} | {s['precision']} | "
                     f"{s['measured_bytes_per_param']:.2f} | {s['predicted_bytes_per_param']:.2f} |")  # fmt: skip
    lines += ["", f"## Compile: {TIMING_MODEL}, bf16, AdamW, {TIMING_STEPS} steps, one case at a time", "",
              "| backend | compile | status | step s (median after warm-up) | compile s | samples/s | MFU |",
              "|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for t in result["timing"]:
        lines.append(f"| {t['backend']} | {t['compile']} | {t['status']} | {fmt(t.get('step_s'), digits=4)} | "
                     f"{fmt(t.get('compile_s'))} | {fmt(t.get('samples_per_s'))} | {fmt(t.get('mfu'), digits=3)} |")  # fmt: skip
    for backend in ("accelerator", "trainer"):
        off, on = (next((t for t in result["timing"] if t["backend"] == backend and t["compile"] == c), {})
                   for c in ("off", "on"))  # fmt: skip
        speedup = ratio(off.get("step_s"), on.get("step_s"))
        if speedup:
            lines.append(f"\n{backend}: compile=on's step is {speedup:.2f}x as fast as compile=off's")
    lines += ["", f"## FSDP2, one rank: {TIMING_MODEL}, bf16, AdamW, CPU offload off / on (MiB)", "",
              "| offload | status | " + " | ".join(FSDP_KEYS) + " | step s |", "|---|---|" + "---:|" * 6]  # fmt: skip
    for f in result["fsdp"]:
        cells = " | ".join(fmt(f.get(key), MIB) for key in FSDP_KEYS)
        lines.append(
            f"| {str(f['offload']).lower()} | {f['status']} | {cells} | {fmt(f.get('step_s'), digits=4)} |"
        )
    lines.append("\nThe split over ranks needs several GPUs: `torchrun --nproc_per_node N train.py parallel=fsdp`, "
                 "every rank's figures in summary_ranks.json.")  # fmt: skip
    if result.get("offloading"):  # results written before the lever have none
        lines += ["", f"## Memory levers: {TIMING_MODEL}, bf16, AdamW, {TIMING_STEPS} steps, one case at a time "
                  "(MiB; predicted / measured)", "",
                  "| recompute | lever | status | step peak | activations | host (offloaded) | max allocated | step s |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for o in result.get("offloading", []):
            pairs = [f"{fmt(o.get(f'{k}_predicted_bytes'), MIB)} / {fmt(o.get(f'{k}_measured_bytes'), MIB)}"
                     for k in ("step_peak", "activations", "host_offloaded")]  # fmt: skip
            lever = o.get(
                "lever", "activation_offloading" if o.get("offloading") else "none"
            )  # older results
            lines.append(f"| {str(o['checkpointing']).lower()} | {lever} | {o['status']} | "
                         f"{' | '.join(pairs)} | {fmt(o.get('cuda_max_allocated_bytes'), MIB)} | "
                         f"{fmt(o.get('step_s'), digits=4)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu.md and gpu.json")
    parser.add_argument("--dry-run", action="store_true", help="check that every case composes; run nothing")
    parser.add_argument("--optimizers", nargs="+", default=OPTIMIZERS, help="options of conf/optimizer")
    parser.add_argument("--jobs", type=int, default=4, help="memory cases run at once (one process each)")
    parser.add_argument("--timeout", type=float, default=420, help="seconds one case may take")
    parser.add_argument("--phases", default="memory,fsdp,timing,offloading",
                        help="which of memory,fsdp,timing,offloading to run")  # fmt: skip
    args = parser.parse_args()
    memory, timing, fsdp = memory_cases(args.optimizers) + adapter_cases(), timing_cases(), fsdp_cases()
    offloading = offloading_cases()
    phases = set(args.phases.split(","))
    if not phases <= {"memory", "fsdp", "timing", "offloading"}:
        raise SystemExit(f"--phases={args.phases!r} is invalid: give some of memory,fsdp,timing,offloading")
    memory, fsdp, timing, offloading = (cases if name in phases else [] for name, cases in
                                        (("memory", memory), ("fsdp", fsdp), ("timing", timing),
                                         ("offloading", offloading)))  # fmt: skip
    if args.dry_run:
        dry_run(memory + timing + fsdp + offloading)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu.py: no CUDA device here; --dry-run checks the cases without one")
    from effitrain.run.isolated import run_isolated

    started = time.time()
    result = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "libraries": {name: metadata.version(name) for name in ("transformers", "accelerate", "peft", "bitsandbytes")},
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "seconds": 0.0,
        "memory": [], "adam8bit_saving": [], "timing": [], "fsdp": [], "offloading": [],
    }  # fmt: skip

    def write() -> None:
        """Both files after every phase: a machine taken back mid-way still leaves the phases done."""
        result["seconds"] = time.time() - started
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "gpu.md").write_text(markdown(result))

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        summaries = list(pool.map(lambda c: run_isolated(c["overrides"], args.timeout), memory))
    result["memory"] = [memory_row(case, summary) for case, summary in zip(memory, summaries)]
    result["adam8bit_saving"] = eight_bit_savings(result["memory"])
    write()
    for case in fsdp:
        s = run_isolated(case["overrides"], args.timeout)
        result["fsdp"].append({"offload": case["offload"], "status": s["status"], "error": s.get("error"),
                               **{key: s.get(f"mem/{key}") for key in FSDP_KEYS},
                               "step_s": s.get("speed/step_s_median")})  # fmt: skip
    write()
    for case in timing:
        s = run_isolated(case["overrides"], args.timeout)
        result["timing"].append({"backend": case["backend"], "compile": case["compile"], "status": s["status"],
                                 "error": s.get("error"), "step_s": s.get("speed/step_s_median"),
                                 "compile_s": s.get("speed/compile_s"), "samples_per_s": s.get("speed/samples_per_s"),
                                 "mfu": s.get("speed/mfu")})  # fmt: skip
        write()
    for case in offloading:  # alone, as the timing cases: the host link's time is what it costs
        s = run_isolated(case["overrides"], args.timeout)
        result["offloading"].append({"lever": case["lever"], "checkpointing": case["checkpointing"],
                                     "status": s["status"], "error": s.get("error"),
                                     **{key: s.get(name) for key, name in OFFLOADING_KEYS.items()},
                                     "step_s": s.get("speed/step_s_median")})  # fmt: skip
        write()
    print(markdown(result))


if __name__ == "__main__":
    main()
