"""The memory levers study's table for docs/levers.md: per job its levers, the step peak measured and
predicted, the categories the levers move, and the losses, read from each job's summary.json.

    python benchmarks/levers_table.py multirun/memory_levers/<date_time>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MIB = 2**20
LEVERS = ("gradient_checkpointing", "activation_offloading", "loss_chunks", "optimizer_in_backward")


def main(folder: str) -> None:
    from effitrain.run.results import job_folders

    print("| # | recompute | offload | chunks | in backward | step peak MiB | predicted | activations | "
          "gradients | last train loss | eval loss |")  # fmt: skip
    print("|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for number, job in enumerate(job_folders(Path(folder)), 1):
        s = json.loads((job / "summary.json").read_text())
        # cfg/<key> since the levers landed; the run's config record before
        levers = [str(s.get(f"cfg/{key}", s["job/config"].get(key))).lower() for key in LEVERS]
        mib = [s[key] / MIB for key in ("mem/step_peak_bytes", "mem/step_peak_bytes_predicted",
                                        "mem/step_peak/activations_bytes", "mem/step_peak/gradients_bytes")]  # fmt: skip
        print(
            f"| {number} | {' | '.join(levers)} | {' | '.join(f'{v:.1f}' for v in mib)} | "
            f"{s['train/loss']!r} | {s['eval/loss']:.4f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
