"""Where one ``effitrain plan`` answer spends its time: the wall seconds of the functions that make it,
summed over their calls in one run (each wrapped in a timer), beside the whole.

    python benchmarks/plan_parts.py                      # the 7B-shaped plan (answer_speed's llama_7b_plan)
    python benchmarks/plan_parts.py --case levers_plan   # another of benchmarks/answer_speed.py's cases

Nested functions count inside their callers (the shared replays hold the replays of fewer blocks). The
answer is computed without the trace cache (``--no-cache``), as a first answer is.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from answer_speed import CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="llama_7b_plan", choices=[c for c in CASES if CASES[c][0] == "plan"])
    args = parser.parse_args()

    import effitrain.commands.plan_check as plan_check
    import effitrain.config.compose as compose
    import effitrain.memory.replay as replay
    import effitrain.memory.shared_traces as shared_traces

    parts = {  # label -> (module, function): the name each module calls it by
        "the shared replays (each optimizer's trace)": (shared_traces, "trace_runs"),
        "  their replays of fewer blocks": (shared_traces, "by_groups"),
        "  each optimizer's own step": (shared_traces, "_own_step"),
        "  FLOP counts": (replay, "counted_by_groups"),
        "the confirming full replay": (plan_check, "confirm"),
        "Hydra compositions": (compose, "compose"),
    }
    spent = {label: [0, 0.0] for label in parts}
    for label, (module, name) in parts.items():
        original = getattr(module, name)

        def timed(*a, _original=original, _label=label, **k):
            start = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                spent[_label][0] += 1
                spent[_label][1] += time.perf_counter() - start

        setattr(module, name, functools.wraps(original)(timed))
    from effitrain.cli import main as cli

    start = time.perf_counter()
    cli([*CASES[args.case], "--no-cache", "--json"])
    total = time.perf_counter() - start
    print(f"{args.case}: {total:.1f} s in all", file=sys.stderr)
    for label, (calls, seconds) in spent.items():
        print(f"{label:46} {calls:4d} calls {seconds:7.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
