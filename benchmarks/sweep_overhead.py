"""Sweep overhead: K tiny jobs one at a time against ``max_parallel=2``, and each job's start-up share.

    python benchmarks/sweep_overhead.py                 # K=4 jobs of 8 steps, 2 rounds
    python benchmarks/sweep_overhead.py --jobs 6 --rounds 3 max_steps=20

Each round runs the same sweep (``seed=1..K``, tiny model, synthetic data) twice through
``python train.py -m``, into fresh folders: once with ``hydra.launcher.max_parallel=1`` and once
with ``max_parallel=2`` (each job pinned to its own cores), interleaved so a busy machine slows both
alike. Printed per round and as the median over rounds:

* the sweep's wall time (command start to exit), and parallel over sequential;
* per job: ``speed/startup_s`` from its ``summary.json`` (process creation to the first training
  step: interpreter, imports, data, model) over the job's process lifetime as the launcher measured
  it (``<sweep>/.effitrain/launches.jsonl``: start to exit), i.e. the share of a job that is start-up;
* the sweep's own time before its first job starts (composing and checking every job).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "model=tiny",
    "data=synthetic",
    "data.num_train=64",
    "data.num_eval=32",
    "epochs=100",
    "micro_batch_size=8",
    "eval_batch_size=32",
    "progress_bar=false",
    "logger=none",
]


def sweep(folder: Path, jobs: int, parallel: int, extra: list[str]) -> dict:
    seeds = ",".join(str(i) for i in range(1, jobs + 1))
    command = [sys.executable, str(REPO / "train.py"), "-m", *TINY, "max_steps=8", *extra, f"seed={seeds}",
               f"hydra.launcher.max_parallel={parallel}", f"hydra.sweep.dir={folder}"]  # fmt: skip
    started = time.time()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(
            f"sweep failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    launches = [
        json.loads(line) for line in (folder / ".effitrain" / "launches.jsonl").read_text().splitlines()
    ]
    summaries = [json.loads(p.read_text()) for p in folder.glob("*/summary.json")]
    assert len(summaries) == jobs and all(s["status"] == "ok" for s in summaries)
    lifetimes = {line["pid"]: line["ended"] - line["started"] for line in launches}
    shares = [s["speed/startup_s"] / lifetimes[s["env/pid"]] for s in summaries]
    return {
        "wall_s": wall,
        "before_first_job_s": min(line["started"] for line in launches) - started,
        "startup_s": statistics.median(s["speed/startup_s"] for s in summaries),
        "job_s": statistics.median(lifetimes.values()),
        "startup_share": statistics.median(shares),
        "train_s": statistics.median(s["speed/train_s"] for s in summaries),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4, help="jobs per sweep (K)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both sweeps")
    parser.add_argument("overrides", nargs="*", help="more overrides for every job, e.g. max_steps=20")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("EFFITRAIN_CACHE_DIR", tempfile.mkdtemp(prefix="effitrain-cache-"))
    print(f"{args.jobs} jobs per sweep, {os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable")
    rows = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for parallel in (1, 2):
                result = sweep(Path(scratch) / f"r{round_}-p{parallel}", args.jobs, parallel, args.overrides)
                rows[parallel].append(result)
                print(
                    f"round {round_ + 1} max_parallel={parallel}: sweep {result['wall_s']:.1f} s "
                    f"(before the first job {result['before_first_job_s']:.1f} s); per job {result['job_s']:.1f} s, "
                    f"start-up {result['startup_s']:.1f} s = {result['startup_share']:.0%}, "
                    f"training {result['train_s']:.2f} s"
                )

    def median(parallel: int, key: str) -> float:
        return statistics.median(r[key] for r in rows[parallel])

    print()
    print(
        f"{'':<16}{'sweep s':>10}{'job s':>10}{'startup s':>11}{'startup share':>15}{'before 1st job s':>18}"
    )
    for parallel in (1, 2):
        print(
            f"max_parallel={parallel:<3}{median(parallel, 'wall_s'):>10.1f}{median(parallel, 'job_s'):>10.1f}"
            f"{median(parallel, 'startup_s'):>11.1f}{median(parallel, 'startup_share'):>15.0%}"
            f"{median(parallel, 'before_first_job_s'):>18.1f}"
        )
    ratios = [p2["wall_s"] / p1["wall_s"] for p1, p2 in zip(rows[1], rows[2])]
    print(
        f"parallel / sequential sweep time: {statistics.median(ratios):.2f} (median of {len(ratios)} rounds)"
    )


if __name__ == "__main__":
    main()
