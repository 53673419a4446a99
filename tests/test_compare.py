"""``effitrain compare`` on what real sweeps wrote: the table holds the summaries' values, the plots
have content, the HTML embeds them, and no folder makes it end in a traceback."""

from __future__ import annotations

import base64
import csv
import json
import shutil

import numpy as np
import pytest

from effitrain.cli import main
from effitrain.compare import CSV_KEYS, pareto_front
from tests.conftest import train_py

SWEEP = ["model=tiny", "data=synthetic", "max_steps=3", "micro_batch_size=8", "progress_bar=false"]


def sweep(folder, *overrides):
    """A real multirun (one process per job), as a user starts it; returns its folder."""
    done = train_py("-m", *SWEEP, *overrides, f"hydra.sweep.dir={folder}")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return folder, done


@pytest.fixture(scope="module")
def wandb_sweep(tmp_path_factory):
    """Two optimizers, logged to W&B offline: the sweep that made compare crash before."""
    folder, done = sweep(tmp_path_factory.mktemp("wandb") / "sweep", "optimizer=adamw,adafactor",
                         "logger=wandb", "logger.mode=offline", "logger.project=effitrain-tests")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def failing_sweep(tmp_path_factory):
    """One job trains, one diverges (an absurd learning rate), without W&B."""
    folder, done = sweep(tmp_path_factory.mktemp("fail") / "sweep", "logger=none", "optimizer.lr=1e-3,1e30", *FAILING)  # fmt: skip
    assert done.returncode == 1 and "1 of 2 jobs failed" in done.stdout, done.stdout + done.stderr[-2000:]
    return folder


def job(*overrides):
    """A job's folder name: its result-changing overrides, sorted (progress_bar and logger are not)."""
    return ",".join(sorted([o for o in SWEEP if not o.startswith("progress_bar")] + list(overrides)))


FAILING = ["max_grad_norm=0", "warmup_ratio=0"]


def summaries(folder):
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(folder.rglob("summary.json"))}


@pytest.mark.slow
def test_compare_of_a_real_wandb_sweep_holds_the_summaries_values(wandb_sweep, capsys):
    main(["compare", str(wandb_sweep), "--wandb-mode", "disabled"])
    jobs = summaries(wandb_sweep)
    assert sorted(jobs) == [job("optimizer=adafactor"), job("optimizer=adamw")]
    rows = {row["job"]: row for row in csv.DictReader(open(wandb_sweep / "comparison.csv"))}
    assert sorted(rows) == sorted(jobs)
    for name, summary in jobs.items():
        assert summary["status"] == "ok" and rows[name]["optimizer"] == name.rpartition("=")[2]
        for key in CSV_KEYS:
            value = summary.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert float(rows[name][key]) == pytest.approx(value, rel=1e-12), key
            else:
                assert rows[name][key] == ("" if value is None else str(value)), key
    assert "logger" not in rows[name]  # run-invariant: never a column
    assert rows[name]["sweep"] == str(wandb_sweep)
    terminal = capsys.readouterr().out
    assert "adafactor" in terminal and "effitrain: compare: 2 jobs" in terminal


@pytest.mark.slow
def test_the_wandb_table_lands_in_the_jobs_project_and_group(wandb_sweep):
    from tests.test_loggers import inspect_records, inspect_summary, wandb_files

    jobs = list(summaries(wandb_sweep).values())
    assert {job["wandb/project"] for job in jobs} == {"effitrain-tests"}
    before = set(wandb_files(wandb_sweep / "wandb"))
    main(["compare", str(wandb_sweep), "--wandb-mode", "offline"])
    [run_file] = set(wandb_files(wandb_sweep / "wandb")) - before
    run = next(r for r in inspect_records(run_file) if r["type"] == "run")["run"]
    assert (run["project"], run["run_group"], run["job_type"]) == (
        "effitrain-tests",
        jobs[0]["wandb/group"],
        "compare",
    )
    assert inspect_summary(run_file)["summary"]["jobs"] == 2
    [table_file] = (run_file.parent / "files").rglob("comparison_*.table.json")
    table = json.loads(table_file.read_text())
    rows = {row[table["columns"].index("job")]: dict(zip(table["columns"], row)) for row in table["data"]}
    adamw = summaries(wandb_sweep)[job("optimizer=adamw")]
    assert rows[job("optimizer=adamw")]["mem/optimizer_state_bytes"] == adamw["mem/optimizer_state_bytes"]


@pytest.mark.slow
def test_failed_missing_and_unreadable_jobs_are_reported_not_raised(failing_sweep, tmp_path, capsys):
    copy = tmp_path / "sweep"
    shutil.copytree(failing_sweep, copy, ignore=shutil.ignore_patterns(".cache"))
    broken = copy / "broken"
    (broken / ".hydra").mkdir(parents=True)
    (broken / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=3\n")
    (broken / "summary.json").write_text('{"status": "ok", "train')  # torn
    main(["compare", str(copy)])
    rows = {row["job"]: row for row in csv.DictReader(open(copy / "comparison.csv"))}
    assert rows[job(*FAILING, "optimizer.lr=0.001")]["status"] == "ok"
    assert rows[job(*FAILING, "optimizer.lr=1e+30")]["status"] == "diverged"
    assert rows["broken"]["status"] == "missing"
    markdown = (copy / "comparison.md").read_text()
    assert "lr=1e+30: diverged: train/loss is nan at optimizer step" in markdown
    out = capsys.readouterr().out
    assert "not ok: broken: missing" in out


@pytest.mark.slow
def test_several_sweep_folders_make_one_table(wandb_sweep, failing_sweep, tmp_path):
    main(["compare", str(wandb_sweep), str(failing_sweep), "--output", str(tmp_path / "report"),
          "--wandb-mode", "disabled"])  # fmt: skip
    rows = list(csv.DictReader(open(tmp_path / "report" / "comparison.csv")))
    assert sorted(row["sweep"] for row in rows) == sorted([str(wandb_sweep)] * 2 + [str(failing_sweep)] * 2)
    assert (tmp_path / "report" / "comparison.html").exists()


@pytest.mark.slow
def test_plots_have_content_and_the_html_embeds_them(wandb_sweep):
    import matplotlib.image

    main(["compare", str(wandb_sweep), "--wandb-mode", "disabled"])
    page = (wandb_sweep / "comparison.html").read_text()
    pngs = sorted(wandb_sweep.glob("*.png"))
    assert {p.name for p in pngs} == {"memory.png", "loss.png", "pareto.png", "lr_grad_norm.png"}
    for path in pngs:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[0] > 300 and pixels.shape[1] > 600
        # a blank or single-colour image has no variance; drawn bars, lines and text do
        assert float(np.std(pixels[..., :3])) > 0.05, path.name
        assert len(np.unique(pixels[..., :3].reshape(-1, 3), axis=0)) > 50, path.name
        assert f"data:image/png;base64,{base64.b64encode(data).decode()}" in page
    assert page.count("<tr") == 3
    assert 'src="memory.png"' not in page  # self-contained: nothing to fetch


@pytest.mark.slow
def test_missing_folder_and_read_only_output_are_one_line(wandb_sweep, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(tmp_path / "nowhere")])
    assert exit_.value.code == 2
    assert "is not a folder" in capsys.readouterr().err
    blocker = tmp_path / "a-file"  # a folder that cannot be made, also for root
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(wandb_sweep), "--output", str(blocker / "report"), "--wandb-mode", "disabled"])
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"effitrain: error: --output={str(blocker / 'report')!r} is invalid: cannot be written"
    )


def test_pareto_front_keeps_points_nothing_beats_on_both_axes():
    points = [(300, 0.72), (250, 0.75), (400, 0.70), (350, 0.80), (250, 0.76)]
    assert pareto_front(points) == [1, 0, 2]


@pytest.mark.slow
def test_a_sweep_without_wandb_logs_no_table(failing_sweep):
    main(["compare", str(failing_sweep), "--wandb-mode", "offline"])
    assert not (failing_sweep / "wandb").exists()


@pytest.mark.slow
def test_repeated_seeds_are_compared_as_mean_and_spread(tmp_path):
    import statistics

    folder, done = sweep(tmp_path / "seeds", "logger=none", "optimizer=adamw,adafactor", "seed=1,2")
    assert done.returncode == 0, done.stderr[-3000:]
    main(["compare", str(folder)])
    jobs = summaries(folder)
    rows = {row["combination"]: row for row in csv.DictReader(open(folder / "comparison_seeds.csv"))}
    # each optimizer's own default lr differs too, so it names the combination as well
    assert sorted(rows) == ["adafactor | lr=0.0003", "adamw | lr=0.0002"]
    for optimizer, lr in (("adamw", "0.0002"), ("adafactor", "0.0003")):
        losses = [s["eval/loss"] for name, s in jobs.items() if name.endswith(f"optimizer={optimizer},seed=1")
                  or name.endswith(f"optimizer={optimizer},seed=2")]  # fmt: skip
        assert len(losses) == 2 and losses[0] != losses[1]  # the seeds differ
        row = rows[f"{optimizer} | lr={lr}"]
        assert int(row["seeds"]) == 2
        assert float(row["eval/loss/mean"]) == pytest.approx(statistics.fmean(losses), rel=1e-12)
        assert float(row["eval/loss/std"]) == pytest.approx(statistics.stdev(losses), rel=1e-9)
    markdown = (folder / "comparison.md").read_text()
    assert "Repeated seeds (mean +- standard deviation):" in markdown and "![seeds](seeds.png)" in markdown
    assert "Repeated seeds" in (folder / "comparison.html").read_text()


def test_a_summary_that_is_json_but_not_an_object_is_reported_not_raised(tmp_path, capsys):
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "summary.json").write_text("[1, 2]")  # valid JSON, not a summary
    main(["compare", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "comparison.csv")))
    assert [(row["job"], row["status"]) for row in rows] == [("listed", "missing")]
    assert "not ok: listed: missing: summary.json cannot be read (damaged)" in capsys.readouterr().out
