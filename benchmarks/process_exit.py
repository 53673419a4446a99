"""What a process's end costs with and without :mod:`effitrain.util.process_exit`'s ``gc.freeze``.

    python benchmarks/process_exit.py               # from the repository's root; 3 interleaved rounds
    python benchmarks/process_exit.py --rounds 5

Each case runs as a user runs it (``python train.py ...``, ``python -m effitrain.cli check ...``:
the entry point that freezes) and as the same function called from ``python -c`` (the
interpreter's shutdown left as it is), in interleaved rounds (A B, A B, ...) so a busy machine slows
both alike; the medians of whole-process wall times are printed with their difference.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

TINY = ["model=tiny", "data=synthetic", "logger=none"]
CASES = {
    "check": (
        [sys.executable, "-m", "effitrain.cli", "check", *TINY],
        [
            sys.executable,
            "-c",
            "import sys; from effitrain.cli import main; main(sys.argv[1:])",
            "check",
            *TINY,
        ],
    ),
    "train (2 steps)": (
        [sys.executable, "train.py", *TINY, "max_steps=2"],
        [
            sys.executable,
            "-c",
            "import sys; from effitrain.commands.train_command import train; train(sys.argv[1:])",
            *TINY,
            "max_steps=2",
        ],
    ),  # fmt: skip
}


def timed(command: list[str], folder: str) -> float:
    """Wall seconds of ``command``, its run folder (a run's outputs; a check's folder it checks) ``folder``."""
    started = time.perf_counter()
    subprocess.run([*command, f"hydra.run.dir={folder}"], check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{'case':16} {'frozen s':>9} {'plain s':>8} {'saved s':>8}   (median of {args.rounds} rounds)")
    for case, (frozen, plain) in CASES.items():
        times: dict[str, list[float]] = {"frozen": [], "plain": []}
        for _ in range(args.rounds):
            for name, command in (("frozen", frozen), ("plain", plain)):
                with tempfile.TemporaryDirectory() as folder:
                    times[name].append(timed(command, folder))
        a, b = statistics.median(times["frozen"]), statistics.median(times["plain"])
        print(f"{case:16} {a:9.2f} {b:8.2f} {b - a:8.2f}")


if __name__ == "__main__":
    main()
