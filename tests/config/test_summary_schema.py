"""The summary schema's rules, on numbers: when one figure beats another beyond noise, and when a run
learned nothing (its eval loss not below its task's input-blind loss)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from effitrain.config.summary_schema import Estimate, beyond_noise, learned_nothing


def test_beyond_noise_needs_more_than_two_combined_deviations_and_more_than_a_thousandth():
    assert beyond_noise(Estimate(0.90, 0.01), Estimate(1.00, 0.02), lower_is_better=True)  # 0.1 > 2 * 0.0224
    assert not beyond_noise(Estimate(0.97, 0.01), Estimate(1.00, 0.02), lower_is_better=True)  # 0.03 < 0.0447
    assert not beyond_noise(Estimate(0.9995, 0.0), Estimate(1.0, 0.0), lower_is_better=True)  # within 1e-3
    assert not beyond_noise(Estimate(0.5, None), Estimate(1.0, 0.0), lower_is_better=True)  # spread unknown
    assert beyond_noise(Estimate(2.0, 0.1), Estimate(1.0, 0.1), lower_is_better=False)


@pytest.mark.parametrize(
    ("summary", "expected"),
    [
        ({"eval/loss": 0.80, "eval/input_blind_loss": 0.837, "eval/loss_sem": 0.01}, None),  # 0.037 > 0.02
        ({"eval/loss": 0.82, "eval/input_blind_loss": 0.837, "eval/loss_sem": 0.01}, (0.82, 0.837)),  # noise
        # the tiny classifier after 2 steps: 0.0014 below ln 3, within 2 x its sampling error
        (
            {"eval/loss": 1.0972, "eval/input_blind_loss": math.log(3), "eval/loss_sem": 0.005},
            (1.0972, math.log(3)),
        ),
        ({"eval/loss": 1.2, "eval/input_blind_loss": 1.0}, (1.2, 1.0)),  # worse than ignoring the input
        ({"eval/loss": 0.5, "eval/input_blind_loss": 1.0}, None),  # no spread known: plainly below
        ({"eval/loss": 0.5}, None),  # no reference: nothing said
        ({"eval/loss": float("nan"), "eval/input_blind_loss": 1.0}, None),
    ],
)
def test_learned_nothing_is_an_eval_loss_not_below_the_input_blind_loss_beyond_noise(summary, expected):
    assert learned_nothing(summary) == expected


def test_compare_takes_the_input_blind_loss_the_run_wrote_without_reading_its_data():
    from effitrain.compare.learning import PRIOR, UNIGRAM, reference_loss
    from effitrain.compare.load import JobResult

    job = JobResult(
        Path("s"), Path("s/j"), {"cfg/task": "classification", "eval/input_blind_loss": 0.837}, {}
    )
    assert reference_loss(job) == (PRIOR, 0.837)  # no job/config: the data could not have been read
    job.summary = {"cfg/task": "causal_lm", "eval/input_blind_loss": 5.0, "train/unigram_perplexity": 99.0}
    assert reference_loss(job) == (UNIGRAM, 5.0)
