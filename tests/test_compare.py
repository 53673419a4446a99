"""``effitrain compare``: the table holds the summaries' values, the plots have content, the HTML embeds them."""

from __future__ import annotations

import base64
import csv
import json

import numpy as np
import pytest

from effitrain.cli import main
from effitrain.compare import MIB, pareto_front
from effitrain.results import write_json_atomic

# Three jobs of a sweep over optimizer x accumulation, written as run() and Hydra would: one failed.
JOBS = {
    "gradient_accumulation_steps=1,optimizer=adamw": {
        "status": "ok", "error": None,
        "mem/optimizer_state_bytes": 8 * 1_000_000, "mem/optimizer_bytes_per_param": 8.0,
        "mem/params_bytes": 4_000_000, "mem/grads_bytes": 4_000_000, "mem/peak_bytes": 300 * MIB,
        "train/loss": 0.61, "eval/loss": 0.72, "eval/accuracy": 0.70, "eval/f1": 0.66,
        "speed/samples_per_s": 120.5, "speed/compile_s": 0.25, "speed/wall_s": 61.0,
    },
    "gradient_accumulation_steps=1,optimizer=adam8bit": {
        "status": "ok", "error": None,
        "mem/optimizer_state_bytes": 2_031_250, "mem/optimizer_bytes_per_param": 2.03125,
        "mem/params_bytes": 4_000_000, "mem/grads_bytes": 4_000_000, "mem/peak_bytes": 250 * MIB,
        "train/loss": 0.65, "eval/loss": 0.75, "eval/accuracy": 0.68, "eval/f1": 0.64,
        "speed/samples_per_s": 110.0, "speed/compile_s": 0.5, "speed/wall_s": 64.0,
    },
    "gradient_accumulation_steps=4,optimizer=adamw": {
        "status": "oom", "error": "OutOfMemoryError: CUDA out of memory",
        "mem/optimizer_state_bytes": 8 * 1_000_000, "speed/wall_s": 3.5,
    },
}  # fmt: skip


def _write_sweep(root, jobs=JOBS):
    for name, summary in jobs.items():
        folder = root / name
        write_json_atomic(folder / "summary.json", summary)
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "overrides.yaml").write_text(
            "".join(f"- {o}\n" for o in name.split(",")) + "- sweep=grid\n"
        )
        if summary["status"] == "ok":
            start = 1.1 if "adamw" in name else 1.2
            lines = [{"step": s, "train/loss": start - 0.05 * s, "lr": 1e-4} for s in range(1, 11)]
            (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def test_csv_has_one_row_per_job_with_the_summaries_values(tmp_path, capsys):
    sweep = _write_sweep(tmp_path / "sweep")
    main(["compare", str(sweep)])
    rows = list(csv.DictReader(open(sweep / "comparison.csv")))
    assert len(rows) == 3
    by_job = {row["job"]: row for row in rows}
    assert set(by_job) == set(JOBS)
    for name, summary in JOBS.items():
        row = by_job[name]
        assert row["optimizer"] == name.split("optimizer=")[1]
        assert row["gradient_accumulation_steps"] == name.split(",")[0].split("=")[1]
        assert "sweep" not in row or row["sweep"] == str(sweep)  # the noisy sweep= override is no column
        for key, value in summary.items():
            if isinstance(value, (int, float)):
                assert float(row[key]) == pytest.approx(value, rel=1e-12), key
            else:
                assert row[key] == (value or ""), key
        for key in ("eval/loss", "mem/peak_bytes"):  # absent in the summary: blank, never 0
            if key not in summary:
                assert row[key] == ""

    markdown = (sweep / "comparison.md").read_text()
    # bytes in files, MiB in reports: 8e6 bytes of AdamW state is 7.63 MiB; 300 MiB peak
    assert (
        "| 1 | adamw | ok | 7.63 | 8.00 | 300.0 | 0.6100 | 0.7200 | 0.7000 | 0.6600 | 120.5 | 0.25 | 61.0 |"
        in markdown
    )
    assert "| 4 | adamw | oom | 7.63 |  |  |  |  |  |  |  |  | 3.5 |" in markdown
    assert "OutOfMemoryError: CUDA out of memory" in markdown
    terminal = capsys.readouterr().out
    assert "adam8bit" in terminal and "oom" in terminal and "250.0" in terminal


def test_plots_have_content_and_the_html_embeds_them(tmp_path):
    import matplotlib.image

    sweep = _write_sweep(tmp_path / "sweep")
    main(["compare", str(sweep)])
    page = (sweep / "comparison.html").read_text()
    for name in ("memory.png", "loss.png", "pareto.png"):
        data = (sweep / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = matplotlib.image.imread(sweep / name)
        assert pixels.shape[0] > 300 and pixels.shape[1] > 600
        # a blank or single-colour image has no variance; drawn bars, lines and text do
        assert float(np.std(pixels[..., :3])) > 0.05, name
        assert len(np.unique(pixels[..., :3].reshape(-1, 3), axis=0)) > 50, name
        assert f"data:image/png;base64,{base64.b64encode(data).decode()}" in page
    assert page.count("<tr") == 4 and 'class="failed"' in page
    assert 'src="memory.png"' not in page  # self-contained: nothing to fetch


def test_several_sweep_folders_make_one_table(tmp_path):
    first = _write_sweep(tmp_path / "a")
    second = _write_sweep(tmp_path / "b", {k: v for k, v in JOBS.items() if v["status"] == "ok"})
    main(["compare", str(first), str(second), "--output", str(tmp_path / "report")])
    rows = list(csv.DictReader(open(tmp_path / "report" / "comparison.csv")))
    assert sorted(row["sweep"] for row in rows) == [str(first)] * 3 + [str(second)] * 2
    assert (tmp_path / "report" / "comparison.html").exists()
    assert "| a | 1 | adamw | ok |" in (tmp_path / "report" / "comparison.md").read_text()


def test_missing_folder_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(tmp_path / "nowhere")])
    assert exit_.value.code == 2
    assert "is not a folder" in capsys.readouterr().err


def test_pareto_front_keeps_points_nothing_beats_on_both_axes():
    points = [(300, 0.72), (250, 0.75), (400, 0.70), (350, 0.80), (250, 0.76)]
    assert pareto_front(points) == [1, 0, 2]


def test_a_sweep_that_logged_to_wandb_gets_the_table_in_its_group(tmp_path):
    from tests.test_loggers import inspect_records, inspect_summary, wandb_files

    sweep = _write_sweep(tmp_path / "sweep")
    for name in JOBS:  # as Hydra records a job of a sweep run with hydra.sweep.dir=multirun/grid/1
        (sweep / name / ".hydra" / "hydra.yaml").write_text("hydra:\n  sweep:\n    dir: multirun/grid/1\n")
    (sweep / "wandb").mkdir()  # the jobs logged to W&B
    main(["compare", str(sweep), "--wandb-mode", "offline"])
    [run_file] = wandb_files(sweep / "wandb")
    records = inspect_records(run_file)
    run = next(r for r in records if r["type"] == "run")["run"]
    assert (run["run_group"], run["job_type"], run["display_name"]) == (
        "multirun/grid/1",
        "compare",
        "comparison",
    )
    assert inspect_summary(run_file)["summary"]["jobs"] == 3
    [table_file] = (run_file.parent / "files").rglob("comparison_*.table.json")
    table = json.loads(table_file.read_text())
    rows = {row[table["columns"].index("job")]: dict(zip(table["columns"], row)) for row in table["data"]}
    assert rows["gradient_accumulation_steps=4,optimizer=adamw"]["status"] == "oom"
    assert rows["gradient_accumulation_steps=1,optimizer=adam8bit"]["mem/optimizer_state_bytes"] == 2_031_250


def test_a_sweep_without_wandb_logs_no_table(tmp_path):
    sweep = _write_sweep(tmp_path / "sweep")
    main(["compare", str(sweep), "--wandb-mode", "offline"])
    assert not (sweep / "wandb").exists()
