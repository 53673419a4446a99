"""compare's reading of a sweep: which jobs are ranked, and which one the ratios are taken against."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("summary", "why"),
    [
        ({"status": "ok"}, "eval/loss and mem/step_peak_bytes not a finite number: not ranked"),  # forged
        (
            {"status": "ok", "eval/loss": 0.1, "mem/step_peak_bytes": 9},
            "no config record (job/config): not ranked",
        ),
        (
            {"status": "ok", "eval/loss": float("nan"), "mem/step_peak_bytes": 9, "cfg/seed": 1},
            "eval/loss not a finite number: not ranked",
        ),  # fmt: skip
        ({"status": "ok", "eval/loss": 0.1, "mem/step_peak_bytes": 9, "job/config": {"seed": 1}}, None),
        ({"status": "failed"}, None),  # not ok: not ranked for that reason, none else said
    ],
)
def test_compare_ranks_only_a_job_with_its_figures_and_its_record(summary, why):
    from effitrain.compare.load import JobResult

    job = JobResult(Path("s"), Path("s/j"), summary, {})
    assert job.unranked == why
    assert job.ranked == (summary["status"] == "ok" and why is None)


def test_the_baseline_of_a_grid_is_the_default_combination_named_whole():
    """optimizer x adapter, LoRA first: the ratios were "x AdamW" against lora | adamw; they are against
    full fine-tuning with AdamW (conf/config.yaml's defaults), named whole in the header."""
    from effitrain.compare.load import JobResult, baseline
    from effitrain.compare.table import table_rows

    def job(index, adapter, optimizer, peak):
        summary = {"status": "ok", "eval/loss": 1.0, "mem/step_peak_bytes": peak * 2**20,
                   "cfg/optimizer": optimizer, "cfg/adapter": adapter, "job/config": {}}  # fmt: skip
        choices = {"adapter": adapter, "optimizer": optimizer}
        return JobResult(Path("s"), Path("s", f"job{index}"), summary, {}, choices=choices)

    jobs = [job(0, "lora", "adamw", 100), job(1, "lora", "adafactor", 90), job(2, "none", "adamw", 400),
            job(3, "none", "adafactor", 300)]  # fmt: skip
    name, summary = baseline(jobs)
    assert (name, summary["mem/step_peak_bytes"]) == ("none | adamw", 400 * 2**20)
    headers, rows = table_rows(jobs)
    assert "x none | adamw" in headers
    ratios = [row[headers.index("x none | adamw")] for row in rows]
    assert ratios == ["0.250", "0.225", "1.000", "0.750"]
    # where the sweep lacks the default combination, the first ranked job, named by its number
    assert baseline(jobs[:2] + jobs[3:])[0] == "job 1"
