"""The verdict: which combination to use, or that the evidence does not decide.

Per combination (the jobs that differ only in their seed; every job on its own without repeated
seeds) three ratios against the baseline (:func:`effitrain.compare.load.baseline`: AdamW where the
optimizer varies, else the first ranked job), each with one standard deviation:

- step peak: ``mem/step_peak_bytes`` / the baseline's (exact bytes; the spread over seeds, if any);
- quality: ``eval/loss`` / the baseline's (lower is better); the spread over seeds where a
  combination ran with several, else the eval split's sampling error (``eval/loss_sem``);
- speed: compare's one samples/s (:attr:`effitrain.compare.load.JobResult.speed`: the median over
  the steady optimizer steps, with their spread) / the baseline's; over seeds, the mean and spread
  of the seeds' medians.

A ratio is *within noise* when it is less than two of its standard deviations (or 0.1%) away from
1. The front holds the combinations no other one beats beyond noise on one axis without being worse
beyond noise on another. Jobs of different kinds (task, model, data) are decided apart, each kind
against its own baseline; a job that did not finish ok, or whose eval loss or step peak is not
finite, is never ranked.

The combinations and their ratios are :mod:`effitrain.compare.combinations`'; whether anything was
learned (what quality is judged against) is :mod:`effitrain.compare.learning`'s.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from effitrain.compare.combinations import AXES, Combination, Ratio, combinations, lower_is_better, ratio
from effitrain.compare.learning import learning
from effitrain.compare.load import MIB, NOISE_SIGMAS, JobResult, baseline, beyond_noise, kinds
from effitrain.compare.render import text_table


def dominates_axis(a: Combination, b: Combination, axis: str) -> bool:
    """``a`` better than ``b`` on one axis beyond noise (an unknown spread never decides; exact
    step peaks decide when more than :data:`effitrain.compare.load.SAME` apart)."""
    x, y = getattr(a, axis), getattr(b, axis)
    return x is not None and y is not None and beyond_noise(x, y, lower_is_better(axis))


def dominates(a: Combination, b: Combination) -> bool:
    """``a`` is better than ``b`` beyond noise on some axis and worse beyond noise on none."""
    return any(dominates_axis(a, b, axis) for axis in AXES) and not any(
        dominates_axis(b, a, axis) for axis in AXES
    )


def pareto(combos: list[Combination]) -> list[Combination]:
    """The combinations no other one dominates (:func:`dominates`), in their order."""
    return [c for c in combos if not any(dominates(o, c) for o in combos if o is not c)]


@dataclass
class Verdict:
    baseline: str  # "AdamW", "job 1", or "base" when each kind has its own
    combos: list[Combination]
    front: list[Combination]
    lines: list[str]  # the verdict in words, first the decision
    headers: list[str]
    rows: list[list[str]]
    notes: list[str]

    @property
    def front_numbers(self) -> set[int]:
        """The numbers of the jobs on the front: what the Pareto plot rings."""
        return {number for combo in self.front for number in combo.numbers}

    def text(self) -> str:
        parts = (
            ["Verdict", *self.lines, "", text_table(self.headers, self.rows)]
            if self.rows
            else ["Verdict", *self.lines]
        )
        return "\n".join(parts + [f"  {note}" for note in self.notes])

    def summary(self) -> dict:
        """The verdict as flat keys, for the W&B comparison run's summary."""
        keys = {"verdict": "\n".join(self.lines), "verdict/baseline": self.baseline,
                "verdict/front": [c.name for c in self.front]}  # fmt: skip
        for combo in self.combos:
            for axis, value in combo.ratios.items():
                if value is not None:
                    keys[f"verdict/{combo.name}/{axis}_x_base"] = value.value
                    keys[f"verdict/{combo.name}/{axis}_x_base_std"] = value.std
        return keys


def _fmt_pct(ratio_: Ratio, what_less: str, what_more: str) -> str:
    change = ratio_.value - 1.0
    return f"{abs(change) * 100:.0f}% {what_less if change < 0 else what_more}"


def _decision(
    combos: list[Combination], front: list[Combination], name: str, learned: bool = True
) -> list[str]:
    """The decision in words for one kind's combinations: use one, or pick by constraint. Where no job
    learned (``learned`` False), quality is not yet known: the choice is said on memory and speed alone."""
    if len(combos) == 1:
        return [f"One combination ({combos[0].name}): nothing to choose between."]
    lines = []
    if len(front) == 1:
        winner = front[0]
        reasons = []
        for axis, less, more in (("memory", "less memory", "more memory"), ("quality", "lower eval loss",
                                 "higher eval loss"), ("speed", "slower", "faster")):  # fmt: skip
            r = winner.ratios[axis]
            if r is not None and not r.base and (learned or axis != "quality"):
                unknown = f"{axis} spread unknown" if r.std is None else f"{axis} within noise"
                reasons.append(unknown if r.noise else _fmt_pct(r, less, more))
        why = f"against {name}: {', '.join(reasons)}" if reasons else "it is the baseline"
        if learned:
            lines.append(f"Use {winner.name} ({why}); no other combination beats it beyond noise on "
                         "memory, quality or speed.")  # fmt: skip
        else:
            lines.append(f"On memory and speed alone, until quality can decide: {winner.name} ({why}); no "
                         "other combination beats it beyond noise on either.")  # fmt: skip
    else:
        lines.append(f"The evidence does not decide between {len(front)} combinations on the "
                     "memory/quality/speed front; pick by the constraint you have:")  # fmt: skip
        for axis, what in (
            ("memory", "least step peak"),
            ("quality", "lowest eval loss"),
            ("speed", "fastest"),
        ):
            if axis == "quality" and not learned:
                continue
            placed = [c for c in front if getattr(c, axis) is not None]
            if not placed:
                continue
            pick = min if lower_is_better(axis) else max
            best = pick(placed, key=lambda c: getattr(c, axis).value)
            tied = [c for c in placed if c is not best and not dominates_axis(best, c, axis)]
            r = best.ratios[axis]
            if len(tied) == len(placed) - 1:
                lines.append(f"  {axis}: the front's combinations are within noise of each other")
                continue
            figure = "" if r is None else " (the baseline)" if r.base else f" ({r.text()} x {name})"
            tie = f"; the same within noise: {', '.join(c.numbered for c in tied)}" if tied else ""
            lines.append(f"  {what}: {best.name}{figure}{tie}")
    named = [c.name for c in front] if len(front) <= 6 else [c.numbered for c in front]
    beaten = [c.numbered for c in combos if c not in front]
    lines.append(f"Front (memory/quality/speed): {', '.join(named)}"
                 + (f"; beaten: {', '.join(beaten)}." if beaten else "."))  # fmt: skip
    return lines


def verdict(jobs: list[JobResult]) -> Verdict:
    """The combinations' ratios against the baseline, the front, and the decision in words; with
    jobs of several kinds, each kind apart."""
    combos = combinations(jobs)
    if not combos:
        name, _ = baseline(jobs)
        lines = ["No job finished ok with a finite eval loss and step peak: nothing to compare (see the "
                 "jobs that did not finish below)."]  # fmt: skip
        return Verdict(name, combos, [], lines, [], [], [])
    by_kind = {kind: [c for c in combos if c.kind == kind] for kind in kinds(jobs)}
    by_kind = {kind: mine for kind, mine in by_kind.items() if mine}
    several = len(by_kind) > 1
    front, lines, names, notes = [], [], [], []
    if several:
        lines.append(f"These jobs are of {len(by_kind)} kinds (task | model | data): each is compared only "
                     "within its kind, against its own baseline; no ratio crosses kinds.")  # fmt: skip
    for kind, mine in by_kind.items():
        name, base_summary = baseline(jobs, [job for c in mine for job in c.jobs])
        base_combo = next(c for c in mine if any(job.summary is base_summary for job in c.jobs))
        for combo in mine:
            combo.ratios = {axis: ratio(getattr(combo, axis), getattr(base_combo, axis), combo is base_combo)
                            for axis in AXES}  # fmt: skip
        kind_front = pareto(mine)
        front += kind_front
        names.append(name)
        flat, judged = learning(mine)
        decided = ([flat] if flat else []) + _decision(mine, kind_front, name, learned=flat is None)
        if several:
            numbers = ", ".join(c.numbered for c in mine)
            decided = [f"{kind} (jobs {numbers}; ratios x {name}):"] + [
                f"  {line.strip()}" for line in decided
            ]
            judged = [f"{kind}: {note}" for note in judged]
        lines += decided
        notes += judged
    name = names[0] if not several else "base"
    base_note = f"x {name}" if not several else "x base (each kind's own baseline)"
    notes.insert(0, f"ratios: {base_note} (1 = same; step peak and eval loss: lower is better, samples/s: "
                 f"higher); ± one standard deviation; ~ within noise (less than {NOISE_SIGMAS:g} of them, or "
                 "0.1%, from 1).")  # fmt: skip
    if any(r is not None and r.std is None and not r.base for c in combos for r in c.ratios.values()):
        notes.append("? no spread (fewer than 3 steady steps, or no eval/loss_sem): not evidence either.")
    if max(len(c.jobs) for c in combos) == 1:
        sems = [c.quality.std for c in combos if c.quality and c.quality.std]
        samples = combos[0].jobs[0].summary.get("eval/samples")
        where = f" ({samples} examples, eval loss ± {statistics.fmean(sems):.4f})" if sems and samples else ""
        notes.append(f"one seed per combination: quality differences below the eval split's sampling "
                     f"error{where} are not evidence; repeat seeds (seed=1,2,3) to measure them.")  # fmt: skip
    else:
        notes.append("quality and samples/s: mean ± standard deviation over each combination's seeds.")
    notes.append("samples/s, here as in the All-jobs table and the plots: the median over each job's steady "
                 "optimizer steps (metrics.jsonl, the warm-up steps left out), ± their spread: a busy "
                 "machine widens it. The summary's speed/samples_per_s (all steps) is in comparison.csv.")  # fmt: skip
    headers = ["#", "combination", "step peak MiB", f"step peak x {name}", "eval loss",
               f"eval loss x {name}", "samples/s", f"samples/s x {name}", "front"]  # fmt: skip
    rows = []
    for combo in combos:
        cells = [combo.numbered, combo.label]
        for axis, scale, digits in (("memory", MIB, 1), ("quality", 1, 4), ("speed", 1, 1)):
            estimate, r = getattr(combo, axis), combo.ratios[axis]
            value = ""
            if estimate is not None:
                value = f"{estimate.value / scale:.{digits}f}"
                if estimate.std:
                    value += f" ± {estimate.std / scale:.{digits}f}"
            cells += [value, "" if r is None else r.text(3 if axis == "memory" else 2)]
        cells.append("yes" if combo in front else "")
        rows.append(cells)
    return Verdict(name, combos, front, lines, headers, rows, notes)
