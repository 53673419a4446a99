"""How long ``effitrain estimate`` and ``plan`` take to answer: today's path (a full replay per
optimizer and candidate, ``--no-share --no-cache``) against the shared replay, first call (empty
cache) and second call (cached), side by side in one run, each command in a process of its own.

    python benchmarks/answer_speed.py                      # every case
    python benchmarks/answer_speed.py --cases estimate     # one
    python benchmarks/answer_speed.py --against /tmp/before --skip-today   # this checkout against another

``--against``: the shared and cached answers of the effitrain in that folder (a checkout of an earlier
commit, imported through ``PYTHONPATH`` ahead of this one) run beside this checkout's, each case's
pair in turn, so that both meet the same load; ``--skip-today`` leaves the slow full replays out.

Each case's answers are compared: the shared and cached figures must be today's, byte for byte. The
machine's load average is printed beside the times: on a shared machine the seconds are inflated,
the ratios less so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

DISTILBERT = ["model=distilbert_base_cased", "max_length=128"]
LLAMA_7B = [  # Llama-2-7B's shape, randomly initialized from its config: nothing is downloaded
    "task=causal_lm", "model=llama_small", "model.architecture.vocab_size=32000",
    "model.architecture.hidden_size=4096", "model.architecture.intermediate_size=11008",
    "model.architecture.num_hidden_layers=32", "model.architecture.num_attention_heads=32",
    "model.architecture.num_key_value_heads=32", "model.architecture.max_position_embeddings=4096",
    "precision=bf16", "micro_batch_size=1", "max_length=2048", "eval_batch_size=1",
]  # fmt: skip
PLAN_1GIB = ["plan", "--memory-budget", "1GiB", "--effective-batch-size", "16", "--device", "cuda"]
CASES = {
    "estimate": ["estimate", "--device", "cuda", *DISTILBERT],
    "plan": [*PLAN_1GIB, "--optimizers", "adafactor,adam8bit,adamw,adamw_fused", *DISTILBERT],
    "readme_plan": ["plan", "--memory-budget", "64MiB", "model=tiny", "data=synthetic"],
    "llama_7b": ["estimate", "--device", "cuda", *LLAMA_7B],
    # the adapter axis too: {none, lora, qlora} x every optimizer x the precisions x micro batches x
    # checkpointing, distilbert at 1 GiB on CUDA
    "adapter_plan": [*PLAN_1GIB, "--adapters", "none,lora,qlora", *DISTILBERT],
    # every axis with the memory levers: every optimizer x precisions x micro batches x levers
    "levers_plan": [*PLAN_1GIB, *DISTILBERT],
    # the 7B-shaped Llama on one 80 GiB GPU, 8 rows of 2,048 tokens per step: every optimizer, the
    # precisions, micro batches and levers (the micro batch follows from the effective batch)
    "llama_7b_plan": [
        "plan",
        "--memory-budget",
        "80GiB",
        "--effective-batch-size",
        "8",
        "--device",
        "cuda",
        *[o for o in LLAMA_7B if not o.startswith("micro_batch_size=")],
    ],  # fmt: skip
}
# `effitrain check`: a valid configuration and a typo, each answered without --json (issue: under 5 s idle)
CHECKS = {
    "check": ["check", "model=tiny", "data=synthetic"],
    "check_typo": ["check", "model=tiny", "data=synthetic", "optimizer=adamw_typo"],
}
# what is compared between the paths (how a figure was had differs by design)
HOW = ("trace_source", "confirmed_by_full_replay")


def cpu_seconds() -> float:
    """User and system time of the finished child processes: what a command cost the CPUs, which
    other work on a shared machine inflates less than wall time."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def answer(args: list[str], cache_dir: str, code: str | None = None) -> tuple[float, float, dict]:
    """Wall seconds, CPU seconds and the JSON answer of ``effitrain <args> --json`` (``code``: the
    folder whose effitrain is imported)."""
    env = {**os.environ, "EFFITRAIN_CACHE_DIR": cache_dir}
    if code:
        env["PYTHONPATH"] = os.pathsep.join([code, *filter(None, [os.environ.get("PYTHONPATH")])])
    started, cpu = time.perf_counter(), cpu_seconds()
    done = subprocess.run(
        # -P: the working directory not first on the path, so PYTHONPATH's checkout is the one imported
        [sys.executable, "-P", "-m", "effitrain.cli", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return seconds, cpu, json.loads(done.stdout)


def figures(result: dict):
    rows = result.get("candidates") or list(result["optimizers"].values())
    return [{k: v for k, v in row.items() if k not in HOW} for row in rows]


def same_figures(one: dict, other: dict) -> bool:
    """The same figures: every row both answers hold equal, and the same rows fit, ranked alike. A plan leaves out
    the candidates whose counted weights, gradients and state alone exceed the budget (never
    traced); an earlier checkout listed them over budget."""
    if "candidates" not in one:
        return figures(one) == figures(other)
    rows = [{row["command"]: row for row in figures(answer)} for answer in (one, other)]
    common = rows[0].keys() & rows[1].keys()
    fitting = [[c for c, row in found.items() if row["fits"]] for found in rows]  # in rank order
    return fitting[0] == fitting[1] and all(rows[0][c] == rows[1][c] for c in common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = [*CASES, *CHECKS]
    parser.add_argument("--cases", default=",".join(every), help=f"comma-separated of {', '.join(every)}")
    parser.add_argument(
        "--against", help="a folder holding another checkout of effitrain, timed beside this one"
    )
    parser.add_argument("--skip-today", action="store_true", help="leave out today's full replays")
    args = parser.parse_args()
    cases = args.cases.split(",")
    checks = [case for case in cases if case in CHECKS]
    cases = [case for case in cases if case not in CHECKS]
    if args.against:
        return against(cases, args.against, args.skip_today)
    started, cpu = time.perf_counter(), cpu_seconds()
    subprocess.run([sys.executable, "-m", "effitrain.cli", "estimate", "--help"], capture_output=True)
    print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; "
        f"`effitrain estimate --help` (start-up) {time.perf_counter() - started:.1f} s, {cpu_seconds() - cpu:.1f} s CPU"
    )
    print("seconds: wall / CPU (user + system) of the command's process")
    print(f"{'case':<12}{'today':>14}{'shared':>14}{'cached':>14}{'today/shared':>14}{'today/cached':>14}")
    for case in cases:
        with tempfile.TemporaryDirectory() as today_dir, tempfile.TemporaryDirectory() as cache_dir:
            today = None if args.skip_today else answer([*CASES[case], "--no-share", "--no-cache"], today_dir)
            shared = answer(CASES[case], cache_dir)
            cached = answer(CASES[case], cache_dir)
        if not figures(today[2] if today else shared[2]) == figures(shared[2]) == figures(cached[2]):
            raise SystemExit(f"{case}: the shared or cached figures differ from today's")
        runs = (today, shared, cached)
        times = "".join(f"{f'{t[0]:.1f} / {t[1]:.1f}' if t else '-':>14}" for t in runs)
        ratios = "".join(
            f"{f'{today[0] / t[0]:.1f} / {today[1] / t[1]:.1f}' if today else '-':>14}"
            for t in (shared, cached)
        )
        print(f"{case:<12}{times}{ratios}", flush=True)
    for case in checks:  # a check answers in a line: its time, not its figures
        started, cpu = time.perf_counter(), cpu_seconds()
        done = subprocess.run(
            [sys.executable, "-m", "effitrain.cli", *CHECKS[case]], capture_output=True, text=True
        )
        line = (done.stdout + done.stderr).strip().splitlines()[-1]
        print(
            f"{case:<12}{time.perf_counter() - started:>8.1f} / {cpu_seconds() - cpu:.1f}  exit {done.returncode}: {line}"
        )
    same = "the shared and cached figures equal" if args.skip_today else "every case's figures equal today's"
    print(f"load average {os.getloadavg()[0]:.1f} at the end; {same} to the byte")


def against(cases: list[str], other: str, skip_today: bool) -> None:
    """Each case's shared (empty cache) and cached answers, ``other``'s code and this checkout's in turn."""
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; before: {other}")
    print("seconds: wall / CPU (user + system) of the command's process")
    print(
        f"{'case':<12}{'before shared':>15}{'after shared':>15}{'before cached':>15}{'after cached':>15}  load"
    )
    for case in cases:
        found = {}
        with tempfile.TemporaryDirectory() as today_dir:
            today = None if skip_today else answer([*CASES[case], "--no-share", "--no-cache"], today_dir)
        for label, code in (("before", other), ("after", None)):
            with tempfile.TemporaryDirectory() as cache_dir:
                found[label] = (answer(CASES[case], cache_dir, code), answer(CASES[case], cache_dir, code))
        answers = [t[2] for pair in found.values() for t in pair] + ([today[2]] if today else [])
        if not all(same_figures(a, answers[0]) for a in answers):
            raise SystemExit(f"{case}: the figures differ between the two checkouts or paths")
        cells = [found[label][i] for i in (0, 1) for label in ("before", "after")]
        times = "".join(f"{f'{wall:.1f} / {cpu:.1f}':>15}" for wall, cpu, _ in cells)
        print(f"{case:<12}{times}  {os.getloadavg()[0]:.1f}", flush=True)
        if today:
            print(f"{'':<12}today (--no-share --no-cache): {today[0]:.1f} / {today[1]:.1f}")
    print("every case's figures equal to the byte between the checkouts (and today's path, where run)")


if __name__ == "__main__":
    main()
