"""The verdict on known jobs: each expected figure computed here from the jobs' own numbers, never
by the function under test (each of these failed on a bug planted in compare/verdict.py)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from effitrain.compare.load import JobResult
from effitrain.compare.verdict import verdict

MIB = 2**20
SAMPLES_PER_STEP = 16
STEADY = (0.1, 0.1, 0.1, 0.1)  # the steady steps' seconds: 160 samples/s, no spread


def _job(name, peak_mib=100.0, loss=1.0, sem=0.001, step_s=(2.0, 1.0, *STEADY), seed=None, status="ok",
         optimizer="adamw", **summary):  # fmt: skip
    """A job as compare loads it: its summary and one metrics.jsonl line per optimizer step."""
    choices = {"optimizer": optimizer, "lr": name} | ({"seed": str(seed)} if seed is not None else {})
    summary = {"status": status, "cfg/optimizer": optimizer, "cfg/task": "classification", "cfg/model": "tiny",
               "cfg/data": "synthetic", "mem/step_peak_bytes": peak_mib * MIB, "eval/loss": loss,
               "eval/loss_sem": sem, **summary}  # fmt: skip
    metrics = [{"step": i + 1, "train/loss": 1.0, "train/samples": SAMPLES_PER_STEP * (i + 1), "speed/step_s": t}
               for i, t in enumerate(step_s)]  # fmt: skip
    return JobResult(Path("s"), Path("s", f"{name}-{seed}"), summary, {}, metrics, choices)


def _steady_rate(step_s) -> float:
    """Samples per second, the median over the steps after the first two (warm-up), computed here."""
    return statistics.median(SAMPLES_PER_STEP / t for t in step_s[2:])


def _by_label(decided):
    return {c.label.rsplit("=", 1)[1]: c for c in decided.combos}


def test_each_constraint_names_the_best_of_the_front_on_its_axis():
    # three combinations, none beaten: one least memory, one lowest loss, one fastest
    jobs = [
        _job("a", peak_mib=100, loss=0.90, step_s=(2, 1, 0.4, 0.4, 0.4, 0.4)),
        _job("b", peak_mib=300, loss=0.50, step_s=(2, 1, 0.2, 0.2, 0.2, 0.2)),
        _job("c", peak_mib=200, loss=0.70, step_s=(2, 1, 0.1, 0.1, 0.1, 0.1)),
    ]
    decided = verdict(jobs)
    assert {c.label for c in decided.front} == {c.label for c in decided.combos}  # none dominates
    least = min(jobs, key=lambda j: j.summary["mem/step_peak_bytes"]).choices["lr"]
    lowest = min(jobs, key=lambda j: j.summary["eval/loss"]).choices["lr"]
    fastest = max(jobs, key=lambda j: _steady_rate([m["speed/step_s"] for m in j.metrics])).choices["lr"]
    assert (least, lowest, fastest) == ("a", "b", "c")
    picks = {line.split(":")[0].strip(): line for line in decided.lines if line.startswith("  ")}
    assert picks["least step peak"].startswith(f"  least step peak: 1. adamw | lr={least} ")
    assert picks["lowest eval loss"].startswith(f"  lowest eval loss: 2. adamw | lr={lowest} ")
    assert picks["fastest"].startswith(f"  fastest: 3. adamw | lr={fastest} ")


def test_the_quality_spread_with_seeds_is_the_spread_between_them():
    # the eval split's sampling error is tiny; the seeds disagree widely: the seeds' spread is the noise
    losses = {"a": (0.50, 0.90), "b": (0.60, 0.62)}
    jobs = [_job(name, loss=loss, sem=0.001, seed=seed) for name, pair in losses.items()
            for seed, loss in enumerate(pair)]  # fmt: skip
    combos = _by_label(verdict(jobs))
    for name, pair in losses.items():
        assert combos[name].quality.value == pytest.approx(statistics.fmean(pair), rel=1e-12)
        assert combos[name].quality.std == pytest.approx(statistics.stdev(pair), rel=1e-12)
    # 0.70 +- 0.28 against 0.61 +- 0.014: within noise, so neither beats the other (same memory, speed)
    assert len(verdict(jobs).front) == 2


def test_a_combination_dominates_only_beyond_the_noise():
    # 1.000 against 0.995: two standard deviations of the difference are 2 * hypot(sem, sem)
    for sem, beaten in ((0.01, False), (0.001, True)):
        gap, noise = 1.000 - 0.995, 2 * math.hypot(sem, sem)
        assert (gap > noise) is beaten
        decided = verdict([_job("worse", loss=1.000, sem=sem), _job("better", loss=0.995, sem=sem)])
        assert [c.label.split("=")[1] for c in decided.front] == (
            ["better"] if beaten else ["worse", "better"]
        )
    # an exact step peak 0.05% lower is the same (less than 0.1% apart); 5% lower is less
    for peak, beaten in ((99.95, False), (95.0, True)):
        decided = verdict([_job("worse", peak_mib=100), _job("better", peak_mib=peak)])
        assert len(decided.front) == (1 if beaten else 2)


def test_jobs_that_did_not_finish_ok_or_hold_a_non_finite_figure_are_never_ranked():
    jobs = [
        _job("nan", loss=None, optimizer="adamw"),  # ok, but its eval loss is NaN (null in JSON)
        _job(
            "failed", peak_mib=1, loss=0.01, status="failed", optimizer="adamw"
        ),  # the best, had it finished
        _job("inf", peak_mib=float("inf"), optimizer="adamw"),
        _job("fine", peak_mib=300, loss=0.8, optimizer="adafactor"),
        _job("adamw", peak_mib=400, loss=0.9, optimizer="adamw"),
    ]
    decided = verdict(jobs)
    assert [(c.numbers, c.label.split("=")[1]) for c in decided.combos] == [([4], "fine"), ([5], "adamw")]
    assert decided.front_numbers <= {4, 5}
    # the baseline is the ranked AdamW (job 5), not the NaN one listed first
    assert decided.baseline == "AdamW"
    fine = decided.combos[0]
    assert fine.ratios["memory"].value == pytest.approx(300 / 400, rel=1e-12)
    assert [row[0] for row in decided.rows] == ["4", "5"]
    from effitrain.compare.load import failures

    said = failures(jobs)
    assert len(said) == 3 and "eval/loss not a finite number: not ranked" in said[0]


def test_ratios_are_each_combination_over_the_baseline():
    base_s, other_s = (2, 1, 0.1, 0.2, 0.1, 0.2, 0.1), (2, 1, 0.4, 0.3, 0.4, 0.4, 0.5)
    jobs = [_job("x", peak_mib=100, loss=0.6, step_s=other_s, optimizer="adafactor"),
            _job("y", peak_mib=400, loss=0.8, step_s=base_s, optimizer="adamw")]  # fmt: skip
    decided = verdict(jobs)
    assert decided.baseline == "AdamW"
    other = decided.combos[0]
    assert other.ratios["memory"].value == pytest.approx(100 / 400, rel=1e-12)
    assert other.ratios["quality"].value == pytest.approx(0.6 / 0.8, rel=1e-12)
    assert other.ratios["speed"].value == pytest.approx(
        _steady_rate(other_s) / _steady_rate(base_s), rel=1e-12
    )
    assert decided.combos[1].ratios["memory"].base
    assert decided.rows[0][3] == f"{100 / 400:.3f}"


def test_speed_is_the_median_over_the_steady_steps_without_warm_up():
    step_s = (5.0, 4.0, 0.1, 0.2, 0.3, 0.4, 0.5)  # two slow warm-up steps, then steady ones that vary
    [combo] = verdict([_job("a", step_s=step_s)]).combos
    rates = [SAMPLES_PER_STEP / t for t in step_s[2:]]
    assert combo.speed.value == pytest.approx(statistics.median(rates), rel=1e-12)
    mad = statistics.median(abs(r - statistics.median(rates)) for r in rates)
    assert combo.speed.std == pytest.approx(1.4826 * mad, rel=1e-12)
    # over seeds: the mean of the seeds' medians and their spread
    other = (5.0, 4.0, 0.2, 0.2, 0.2)
    [combo] = verdict([_job("a", step_s=step_s, seed=1), _job("a", step_s=other, seed=2)]).combos
    medians = [statistics.median(rates), SAMPLES_PER_STEP / 0.2]
    assert combo.speed.value == pytest.approx(statistics.fmean(medians), rel=1e-12)
    assert combo.speed.std == pytest.approx(statistics.stdev(medians), rel=1e-12)


def test_nothing_learned_is_judged_against_the_unigram_loss_of_a_language_model():
    unigram = 40.0  # perplexity: a loss of ln 40 = 3.689 is what ignoring context scores
    lm = {"cfg/task": "causal_lm", "train/unigram_perplexity": unigram}
    flat = [_job("a", loss=math.log(unigram) + 0.002, sem=0.01, **lm),
            _job("b", loss=math.log(unigram) - 0.001, sem=0.01, **lm)]  # fmt: skip
    assert verdict(flat).lines[0].startswith("No job learned anything measurable: eval loss 3.6879 to 3.6909")
    learned = [_job("a", loss=math.log(unigram) - 0.5, sem=0.01, **lm), flat[1]]
    decided = verdict(learned)
    assert not decided.lines[0].startswith("No job learned")
    assert any(
        note.endswith(f"{math.log(unigram):.4f}; below it beyond noise (learned): 1.")
        for note in decided.notes
    )


def test_nothing_learned_is_judged_against_a_prediction_that_ignores_the_text():
    """A classifier's eval losses around ln 3 learned nothing even where accuracy differs by chance."""
    from collections import Counter

    from effitrain.train.data import load_synthetic

    data = {"_target_": "effitrain.train.data.load_synthetic", "num_train": 90, "num_eval": 30,
            "num_labels": 3, "words_per_text": 6, "seed": 5}  # fmt: skip
    raw = load_synthetic(**{k: v for k, v in data.items() if k != "_target_"})
    train, evaluated = Counter(raw.train["label"]), Counter(raw.eval["label"])
    prior = -sum(n / 30 * math.log(train[c] / 90) for c, n in evaluated.items())
    reference = min(prior, math.log(3))
    config = {"job/config": {f"data.{k}": v for k, v in data.items()}}
    jobs = [_job("a", loss=reference + 0.0001, sem=0.002, **{"eval/accuracy": 0.28}, **config),
            _job("b", loss=reference - 0.0002, sem=0.002, **{"eval/accuracy": 0.58}, **config)]  # fmt: skip
    line = verdict(jobs).lines[0]
    assert (
        line.startswith("No job learned anything measurable: eval loss")
        and "accuracy 0.2800 to 0.5800" in line
    )
    assert f"below {reference:.4f}, the loss of a prediction that ignores the text" in line
    jobs[1].summary["eval/loss"] = reference - 0.05
    assert not verdict(jobs).lines[0].startswith("No job learned")


def test_jobs_of_different_kinds_are_decided_apart():
    lm = {"cfg/task": "causal_lm", "cfg/model": "llama_tiny", "cfg/data": "drug_reviews"}
    jobs = [_job("c1", peak_mib=100, loss=0.9, optimizer="adamw"),
            _job("c2", peak_mib=50, loss=0.9, optimizer="adafactor"),
            _job("l1", peak_mib=900, loss=9.0, optimizer="adamw", **lm),
            _job("l2", peak_mib=600, loss=8.0, optimizer="adafactor", **lm)]  # fmt: skip
    for job in jobs:  # the model is a choice that differs between the jobs, not within a kind
        job.choices["model"] = job.summary["cfg/model"]
    decided = verdict(jobs)
    assert decided.lines[0].startswith("These jobs are of 2 kinds (task | model | data)")
    assert [c.label for c in decided.combos] == ["adamw | lr=c1", "adafactor | lr=c2", "adamw | lr=l1",
                                                 "adafactor | lr=l2"]  # fmt: skip
    assert "classification | tiny | synthetic (jobs 1, 2; ratios x AdamW):" in decided.lines
    assert "causal_lm | llama_tiny | drug_reviews (jobs 3, 4; ratios x AdamW):" in decided.lines
    combos = {c.numbers[0]: c for c in decided.combos}
    assert combos[2].ratios["memory"].value == pytest.approx(50 / 100, rel=1e-12)
    assert combos[4].ratios["memory"].value == pytest.approx(600 / 900, rel=1e-12)
    assert combos[4].ratios["quality"].value == pytest.approx(8.0 / 9.0, rel=1e-12)
    assert combos[3].ratios["memory"].base and combos[1].ratios["memory"].base
    # job 2 beats job 1 and job 4 beats job 3, each within its kind; nothing across kinds
    assert decided.front_numbers == {2, 4}


def _rates_of(step_s):
    rates = [SAMPLES_PER_STEP / t for t in step_s[2:]]
    middle = statistics.median(rates)
    return middle, 1.4826 * statistics.median(abs(r - middle) for r in rates)


def test_one_winner_is_named_with_its_figures_and_the_table_and_notes_hold_them():
    steps = (2, 1, 0.10, 0.11, 0.12, 0.13, 0.14)
    jobs = [_job("x", peak_mib=400, loss=0.8, step_s=steps, optimizer="adamw", **{"eval/samples": 64}),
            _job("y", peak_mib=100, loss=0.6, step_s=steps, optimizer="adafactor", **{"eval/samples": 64})]  # fmt: skip
    decided = verdict(jobs)
    assert decided.lines == [
        "Use 2. adafactor | lr=y (against AdamW: 75% less memory, 25% lower eval loss, speed within noise); "
        "no other combination beats it beyond noise on memory, quality or speed.",
        "Front (memory/quality/speed): 2. adafactor | lr=y; beaten: 1.",
    ]
    speed, spread = _rates_of(steps)
    quality = 0.75 * math.hypot(0.001 / 0.6, 0.001 / 0.8)
    assert decided.headers == ["#", "combination", "step peak MiB", "step peak x AdamW", "eval loss",
                               "eval loss x AdamW", "samples/s", "samples/s x AdamW", "front"]  # fmt: skip
    assert decided.rows == [
        ["1", "adamw | lr=x", "400.0", "1 (base)", "0.8000 ± 0.0010", "1 (base)", f"{speed:.1f} ± {spread:.1f}",
         "1 (base)", ""],
        ["2", "adafactor | lr=y", "100.0", "0.250", "0.6000 ± 0.0010", f"0.75 ± {quality:.2f}",
         f"{speed:.1f} ± {spread:.1f}", f"1.00 ± {math.sqrt(2) * spread / speed:.2f} ~", "yes"],
    ]  # fmt: skip
    assert decided.notes == [
        "ratios: x AdamW (1 = same; step peak and eval loss: lower is better, samples/s: higher); ± one "
        "standard deviation; ~ within noise (less than 2 of them, or 0.1%, from 1).",
        "one seed per combination: quality differences below the eval split's sampling error (64 examples, "
        "eval loss ± 0.0010) are not evidence; repeat seeds (seed=1,2,3) to measure them.",
        "samples/s, here as in the All-jobs table and the plots: the median over each job's steady optimizer "
        "steps (metrics.jsonl, the warm-up steps left out), ± their spread: a busy machine widens it. The "
        "summary's speed/samples_per_s (all steps) is in comparison.csv.",
    ]
    summary = decided.summary()
    assert summary["verdict/baseline"] == "AdamW" and summary["verdict/front"] == ["2. adafactor | lr=y"]
    assert summary["verdict/2. adafactor | lr=y/memory_x_base"] == pytest.approx(0.25, rel=1e-12)
    assert summary["verdict/2. adafactor | lr=y/memory_x_base_std"] == 0.0
    assert "Use 2. adafactor" in decided.text() and "samples/s x AdamW" in decided.text()


def test_an_unknown_spread_is_marked_and_said_and_seeds_are_said():
    short = (2, 1, 0.1, 0.1)  # two steady steps: no spread
    jobs = [_job("x", step_s=short), _job("y", peak_mib=50, loss=0.9, step_s=short, optimizer="adafactor")]
    decided = verdict(jobs)
    assert decided.rows[1][7] == "1.00 ?" and decided.rows[1][6] == f"{SAMPLES_PER_STEP / 0.1:.1f}"
    assert (
        "? no spread (fewer than 3 steady steps, or no eval/loss_sem): not evidence either." in decided.notes
    )
    assert decided.lines[0].startswith("Use 2. adafactor | lr=y (against AdamW: 50% less memory, "
                                       "10% lower eval loss, speed spread unknown)")  # fmt: skip
    seeded = [_job("x", seed=1), _job("x", seed=2, loss=1.01)]
    decided = verdict(seeded)
    assert decided.lines == ["One combination (1=2. adamw | lr=x): nothing to choose between."]
    assert "quality and samples/s: mean ± standard deviation over each combination's seeds." in decided.notes
    assert decided.rows[0][4] == f"{statistics.fmean([1.0, 1.01]):.4f} ± {statistics.stdev([1.0, 1.01]):.4f}"


def test_a_kind_without_adamw_takes_its_first_ranked_job_as_baseline():
    lm = {"cfg/task": "causal_lm", "cfg/model": "llama_tiny"}
    jobs = [_job("a", peak_mib=100, optimizer="adamw"), _job("b", peak_mib=80, optimizer="adafactor"),
            _job("c", peak_mib=300, optimizer="lion", **lm), _job("d", peak_mib=200, optimizer="sgd", **lm)]  # fmt: skip
    decided = verdict(jobs)
    assert "causal_lm | llama_tiny | synthetic (jobs 3, 4; ratios x job 3):" in decided.lines
    # that kind learned nothing (every loss 1.0, no reference): its choice is on memory and speed alone
    assert "  On memory and speed alone, until quality can decide: 4. sgd | lr=d (against job 3: 33% less " \
           "memory, speed within noise); no other combination beats it beyond noise on either." in decided.lines  # fmt: skip
    assert decided.baseline == "base" and decided.headers[3] == "step peak x base"
    assert decided.notes[0].startswith("ratios: x base (each kind's own baseline) (1 = same;")
    assert decided.rows[3][3] == f"{200 / 300:.3f}"


def test_without_a_reference_nothing_learned_means_every_score_the_same():
    same = {"eval/accuracy": 0.34}
    jobs = [_job("a", loss=1.0986, sem=0.001, **same), _job("b", loss=1.0990, sem=0.001, **same)]
    assert verdict(jobs).lines[0] == (
        "No job learned anything measurable: all 2 have eval loss 1.0986 to 1.0990, accuracy 0.3400. Quality "
        "cannot decide here: train longer (max_steps, epochs), raise optimizer.lr, or give the model a task "
        "it can learn (more data.num_train), then compare again."
    )
    jobs[1].summary["eval/accuracy"] = 0.35  # a score differs: something was learned
    assert not verdict(jobs).lines[0].startswith("No job learned")
    jobs[1].summary.update({"eval/accuracy": 0.34, "eval/loss": 1.0986 + 0.0012})  # beyond the sampling error
    assert not verdict(jobs).lines[0].startswith("No job learned")


def test_where_nothing_was_learned_the_choice_is_said_on_memory_and_speed_alone():
    """No eval loss beyond the others' noise and every score the same: quality is unknown, so no
    combination is to be used on it; the lighter one is named on memory alone, and a front of
    several is told by memory and speed only."""
    same = {"eval/accuracy": 0.34}
    jobs = [_job("a", peak_mib=200, loss=1.0986, sem=0.001, **same),
            _job("b", peak_mib=100, loss=1.0990, sem=0.001, optimizer="lion", **same)]  # fmt: skip
    lines = verdict(jobs).lines
    assert lines[0].startswith("No job learned anything measurable")
    assert lines[1] == (
        "On memory and speed alone, until quality can decide: 2. lion | lr=b (against AdamW: 50% less memory, "
        "speed within noise); no other combination beats it beyond noise on either."
    )
    slower = _job("b", peak_mib=100, loss=1.0990, sem=0.001, optimizer="lion", step_s=(2, 1, 0.2, 0.2, 0.2, 0.2),
                  **same)  # fmt: skip
    lines = verdict([jobs[0], slower]).lines  # half as fast: a front of two
    assert lines[1].startswith("The evidence does not decide between 2 combinations")
    assert [line.split(":")[0] for line in lines[2:4]] == ["  least step peak", "  fastest"]
    assert not any("eval loss" in line for line in lines[1:4])


def test_a_front_of_several_is_told_by_constraint_with_its_ties():
    jobs = [_job("a", peak_mib=100, loss=0.90, step_s=(2, 1, 0.4, 0.4, 0.4, 0.4)),
            _job("b", peak_mib=150, loss=0.50, step_s=(2, 1, 0.2, 0.2, 0.2, 0.2)),
            _job("c", peak_mib=200, loss=0.5005, step_s=(2, 1, 0.1, 0.1, 0.1, 0.1))]  # fmt: skip
    quality = 0.5 / 0.9 * math.hypot(0.001 / 0.5, 0.001 / 0.9)
    assert verdict(jobs).lines == [
        "The evidence does not decide between 3 combinations on the memory/quality/speed front; pick by the "
        "constraint you have:",
        "  least step peak: 1. adamw | lr=a (the baseline)",
        f"  lowest eval loss: 2. adamw | lr=b ({0.5 / 0.9:.2f} ± {quality:.2f} x job 1); the same within noise: 3",
        f"  fastest: 3. adamw | lr=c ({(SAMPLES_PER_STEP / 0.1) / (SAMPLES_PER_STEP / 0.4):.2f} x job 1)",
        "Front (memory/quality/speed): 1. adamw | lr=a, 2. adamw | lr=b, 3. adamw | lr=c.",
    ]
    same_speed = [_job("x", peak_mib=100, loss=0.9), _job("y", peak_mib=200, loss=0.5)]
    assert "  speed: the front's combinations are within noise of each other" in verdict(same_speed).lines
    # a kind with one combination keeps every choice in its name
    lm = _job("l", optimizer="lion", **{"cfg/task": "causal_lm"})
    mixed = [*same_speed, lm]
    for job in mixed:
        job.choices["task"] = job.summary["cfg/task"]
    assert [c.label for c in verdict(mixed).combos] == [
        "lr=x",
        "lr=y",
        "lion | lr=l | causal_lm",
    ]
