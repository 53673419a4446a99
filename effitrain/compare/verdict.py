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
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import dataclass, field

from effitrain.compare.load import (
    MIB,
    NOISE_SIGMAS,
    SAME,
    Estimate,
    JobResult,
    _finite,
    baseline,
    beyond_noise,
    combination_label,
    job_kind,
    kinds,
)
from effitrain.train.tasks import reported_metrics

# The quality metrics whose equality across all jobs means nothing was learned measurably: the tasks'.
METRICS = reported_metrics()
QUALITY_KEYS = tuple(metric.key for metric in METRICS)
AXES = ("memory", "quality", "speed")
LOWER_IS_BETTER = {"memory": True, "quality": True, "speed": False}


@dataclass
class Ratio:
    """A combination's value over the baseline's, with one standard deviation of the ratio."""

    value: float
    std: float | None
    base: bool = False  # the baseline's own row

    @property
    def noise(self) -> bool:
        """Within noise of the baseline; an unknown spread (fewer than three steady steps) is no
        evidence either."""
        if self.base or self.std is None:
            return True
        return abs(self.value - 1.0) < max(NOISE_SIGMAS * self.std, SAME)

    def text(self, digits: int = 2) -> str:
        if self.base:
            return "1 (base)"
        cell = f"{self.value:.{digits}f}"
        if self.std is None:
            return cell + " ?"
        if self.std:
            cell += f" ± {self.std:.{digits}f}"
        return cell + (" ~" if self.noise else "")


def ratio(a: Estimate | None, b: Estimate | None, is_base: bool) -> Ratio | None:
    if a is None or b is None or not b.value:
        return None
    value = a.value / b.value
    if a.relative is None or b.relative is None:
        std = None
    else:
        std = abs(value) * math.hypot(a.relative, b.relative)
    return Ratio(value, std, base=is_base)


@dataclass
class Combination:
    numbers: list[int]  # the jobs' numbers, 1-based, as in the table and the plots
    label: str
    jobs: list[JobResult]
    kind: str = ""
    memory: Estimate | None = None
    quality: Estimate | None = None
    speed: Estimate | None = None
    ratios: dict[str, Ratio | None] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{_numbers(self)}. {self.label}"


def _over_seeds(values: list[Estimate]) -> Estimate | None:
    """One seed: its own estimate; several: their mean, and the spread between them."""
    if len(values) > 1:
        return Estimate(statistics.fmean(v.value for v in values), statistics.stdev(v.value for v in values))
    return values[0] if values else None


def combinations(jobs: list[JobResult]) -> list[Combination]:
    """The ranked jobs grouped by kind and every choice but the seed, in job order."""
    groups: dict[tuple[str, str], Combination] = {}
    for number, job in enumerate(jobs, 1):
        if not job.ranked:
            continue
        label = combination_label(job)  # as the seeds table groups them
        group = groups.setdefault((job_kind(job), label), Combination([], label, [], job_kind(job)))
        group.numbers.append(number)
        group.jobs.append(job)
    kinds_seen = {c.kind for c in groups.values()}
    for kind in kinds_seen if len(kinds_seen) > 1 else []:  # named by what differs within their kind
        mine = [c for c in groups.values() if c.kind == kind]
        members = [job for c in mine for job in c.jobs]
        shared = frozenset(k for k in members[0].choices if len({job.choices.get(k) for job in members}) == 1)
        for combo in mine if len(mine) > 1 else []:  # one combination keeps every choice as its name
            combo.label = combination_label(combo.jobs[0], shared)
    for group in groups.values():
        summaries = [job.summary for job in group.jobs]
        # bytes of tensors: exact for one run
        group.memory = _over_seeds([Estimate(s["mem/step_peak_bytes"], 0.0) for s in summaries
                                    if _finite(s.get("mem/step_peak_bytes"))])  # fmt: skip
        sems = [s.get("eval/loss_sem") for s in summaries]
        group.quality = _over_seeds([Estimate(s["eval/loss"], sem if _finite(sem) else None)
                                     for s, sem in zip(summaries, sems) if _finite(s.get("eval/loss"))])  # fmt: skip
        group.speed = _over_seeds([job.speed for job in group.jobs if job.speed is not None])
    return list(groups.values())


def dominates_axis(a: Combination, b: Combination, axis: str) -> bool:
    """``a`` better than ``b`` on one axis beyond noise (an unknown spread never decides; exact
    step peaks decide when more than :data:`SAME` apart)."""
    x, y = getattr(a, axis), getattr(b, axis)
    return x is not None and y is not None and beyond_noise(x, y, LOWER_IS_BETTER[axis])


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
        from effitrain.compare.render import text_table

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


def reference_loss(job: JobResult) -> tuple[str, float] | None:
    """What the job's eval loss must beat to have learned anything, and its value: a causal LM's
    unigram loss (the log of ``train/unigram_perplexity``); a classifier's loss of predicting,
    whatever the text, the training labels' class prior or the uniform distribution, whichever
    scores better on the eval labels (an untrained head predicts about uniformly, and beats a
    prior that the eval split does not share). None where it cannot be known here."""
    unigram = job.summary.get("train/unigram_perplexity")
    if _finite(unigram) and unigram > 0:
        return "the unigram loss (ln of the training split's unigram perplexity)", math.log(unigram)
    config = job.summary.get("job/config")
    if job.summary.get("cfg/task") != "classification" or not isinstance(config, dict):
        return None
    data = {k.removeprefix("data."): v for k, v in config.items() if k.startswith("data.")}
    loss = _prior_loss(json.dumps(data, sort_keys=True, default=str)) if data else None
    what = "the loss of a prediction that ignores the text (the training labels' class prior, or uniform)"
    return None if loss is None else (what, loss)


@functools.cache
def _prior_loss(data: str) -> float | None:
    """The eval labels' cross-entropy under the training labels' frequencies, or under the uniform
    distribution where that is lower; the data loaded as the job loaded it (its recorded ``data``
    node)."""
    from collections import Counter

    from omegaconf import OmegaConf

    from effitrain.train.tasks import Classification

    node: dict = {}
    for key, value in json.loads(data).items():
        *parents, last = key.split(".")
        inner = node
        for part in parents:
            inner = inner.setdefault(part, {})
        inner[last] = value
    try:
        raw = Classification().load(OmegaConf.create(node))
    except (
        Exception
    ):  # the reference is context: data that cannot be read here (moved, hub offline) does not stop compare
        return None
    train, evaluated = Counter(raw.train["label"]), Counter(raw.eval["label"])
    if not train or not evaluated:
        return None
    uniform = math.log(len(raw.label_names))
    if any(label not in train for label in evaluated):  # the prior's loss is infinite there
        return uniform
    total_train, total_eval = sum(train.values()), sum(evaluated.values())
    prior = -sum(n / total_eval * math.log(train[label] / total_train) for label, n in evaluated.items())
    return min(prior, uniform)


def _learning(combos: list[Combination]) -> tuple[str | None, list[str]]:
    """The line that says nothing was learned (or None) and the note on what learning is judged
    against. A combination learned when its eval loss is below its task's reference
    (:func:`reference_loss`) beyond noise; where no reference is known, nothing learned means every
    quality metric the same for all."""
    references = {id(c): reference_loss(c.jobs[0]) for c in combos}
    known = [(c, references[id(c)]) for c in combos if references[id(c)] is not None]
    losses = [c.quality.value for c in combos if c.quality is not None]
    if not losses:
        return None, []
    if not known:
        return _all_the_same(combos), []
    learned = [
        c for c, (_, value) in known if c.quality and beyond_noise(c.quality, Estimate(value, 0.0), True)
    ]
    what = known[0][1][0]
    values = sorted({round(value, 4) for _, (_, value) in known})
    shown = f"{values[0]:.4f}" if len(values) == 1 else f"{values[0]:.4f} to {values[-1]:.4f}"
    learners = ", ".join(_numbers(c) for c in learned) or "none"
    note = (f"learning: judged against {what}, {shown}; below it beyond noise (learned): {learners}.")  # fmt: skip
    if learned or len(known) < len(combos):
        return None, [note]
    # accuracy may differ by chance where no job learned (0.28 against 0.58): each range is said
    scores = []
    for key, name, digits in (("eval/loss", "eval loss", 4), *((m.key, m.label, m.digits) for m in METRICS)):
        values = [job.summary[key] for c in combos for job in c.jobs if _finite(job.summary.get(key))]
        if values:
            scores.append(_span(name, values, digits))
    flat = (f"No job learned anything measurable: {', '.join(scores)}; no eval loss is below {shown}, "
            f"{what}, beyond noise. Quality cannot decide here: train longer (max_steps, epochs), raise "
            "optimizer.lr, or give the model a task it can learn (more data.num_train), then compare again.")  # fmt: skip
    return flat, [note]


def _span(name: str, values: list[float], digits: int) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{name} {low}" if low == high else f"{name} {low} to {high}"


def _all_the_same(combos: list[Combination]) -> str | None:
    """Without a reference: one line when every job scored the same on every quality metric (eval
    losses within the sampling error, or 0.1%)."""
    done = [job.summary for c in combos for job in c.jobs]
    if len(done) < 2:
        return None
    losses = [s["eval/loss"] for s in done if _finite(s.get("eval/loss"))]
    if len(losses) < len(done):
        return None
    sems = sorted(s["eval/loss_sem"] for s in done if _finite(s.get("eval/loss_sem")))
    tolerance = max([SAME * max(abs(v) for v in losses), *sems[:1]])
    if max(losses) - min(losses) > tolerance:
        return None
    said = []
    for key in QUALITY_KEYS:
        values = {round(s[key], 6) for s in done if _finite(s.get(key))}
        if len(values) > 1:
            return None
        if values:
            said.append(f"{key.removeprefix('eval/')} {values.pop():.4f}")
    said.insert(0, f"eval loss {min(losses):.4f} to {max(losses):.4f}")
    return (
        f"No job learned anything measurable: all {len(done)} have {', '.join(said)}. Quality cannot "
        "decide here: train longer (max_steps, epochs), raise optimizer.lr, or give the model a task "
        "it can learn (more data.num_train), then compare again."
    )


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
            pick = min if LOWER_IS_BETTER[axis] else max
            best = pick(placed, key=lambda c: getattr(c, axis).value)
            tied = [c for c in placed if c is not best and not dominates_axis(best, c, axis)]
            r = best.ratios[axis]
            if len(tied) == len(placed) - 1:
                lines.append(f"  {axis}: the front's combinations are within noise of each other")
                continue
            figure = "" if r is None else " (the baseline)" if r.base else f" ({r.text()} x {name})"
            tie = f"; the same within noise: {', '.join(_numbers(c) for c in tied)}" if tied else ""
            lines.append(f"  {what}: {best.name}{figure}{tie}")
    named = [c.name for c in front] if len(front) <= 6 else [_numbers(c) for c in front]
    beaten = [_numbers(c) for c in combos if c not in front]
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
        flat, learning = _learning(mine)
        decided = ([flat] if flat else []) + _decision(mine, kind_front, name, learned=flat is None)
        if several:
            numbers = ", ".join(_numbers(c) for c in mine)
            decided = [f"{kind} (jobs {numbers}; ratios x {name}):"] + [
                f"  {line.strip()}" for line in decided
            ]
            learning = [f"{kind}: {note}" for note in learning]
        lines += decided
        notes += learning
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
        cells = [_numbers(combo), combo.label]
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


def _numbers(combo: Combination) -> str:
    return "=".join(map(str, combo.numbers))
