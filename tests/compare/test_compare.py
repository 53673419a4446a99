"""``effitrain compare`` on what real sweeps wrote: the table holds the summaries' values, the plots
have content, the HTML embeds them, and no folder makes it end in a traceback."""

from __future__ import annotations

import base64
import csv
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from effitrain.cli import main
from effitrain.compare import CSV_KEYS
from tests.helpers.run import REPO, train_py

SWEEP = ["model=tiny", "data=synthetic", "max_steps=3", "micro_batch_size=8", "progress_bar=false"]


def sweep(folder, *overrides):
    """A real multirun (one process per job), as a user starts it; returns its folder."""
    done = train_py("-m", *SWEEP, *overrides, f"hydra.sweep.dir={folder}")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return folder, done


def swept_and_compared(folder, capsys, *overrides):
    """A real sweep that finished, then ``effitrain compare`` of it: the folder and what compare printed."""
    folder, done = sweep(folder, *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    capsys.readouterr()
    main(["compare", str(folder)])
    return folder, capsys.readouterr().out


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


def _finished_records(run_file, seconds: int = 120) -> list[dict]:
    """The records of an offline W&B log once its ``exit`` record is there: wandb's service process
    writes the log, and may still be writing it when ``finish()`` has returned."""
    import time

    from tests.train.test_loggers import inspect_records

    for _ in range(seconds):
        records = inspect_records(run_file)
        if any(r["type"] == "exit" for r in records):
            return records
        time.sleep(1)
    raise AssertionError(f"{run_file} has no exit record after {seconds} s: {[r['type'] for r in records]}")


@pytest.mark.slow
def test_the_wandb_comparison_is_one_run_per_sweep_in_the_jobs_project_and_short_group(wandb_sweep):
    from effitrain.compare.wandb import comparison_run_id
    from tests.train.test_loggers import inspect_summary, wandb_files

    jobs = list(summaries(wandb_sweep).values())
    assert {job["wandb/project"] for job in jobs} == {"effitrain-tests"}
    # the study and its start time: the sweep folder's last two parts, not its absolute path
    assert {job["wandb/group"] for job in jobs} == {f"{wandb_sweep.parent.name}/sweep"}
    before = set(wandb_files(wandb_sweep / "wandb"))
    for _ in range(2):  # twice, as a user would: the same run, not a second (each its own process,
        # which ends once wandb's service has written the offline log)
        done = subprocess.run(
            [sys.executable, "-m", "effitrain.cli", "compare", str(wandb_sweep), "--wandb-mode", "offline"],
            cwd=REPO, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0 and "warning: W&B" not in done.stderr, done.stderr[-3000:]
    [run_file] = set(wandb_files(wandb_sweep / "wandb")) - before
    records = _finished_records(run_file)
    run = next(r for r in records if r["type"] == "run")["run"]
    assert (run["project"], run["run_group"], run["job_type"], run["run_id"]) == (
        "effitrain-tests",
        jobs[0]["wandb/group"],
        "compare",
        comparison_run_id(wandb_sweep),
    )
    summary = inspect_summary(run_file)["summary"]
    assert summary["jobs"] == 2 and summary["verdict/baseline"] == "AdamW"
    assert summary["verdict"].splitlines()[0] in (wandb_sweep / "comparison.md").read_text()
    adamw = summaries(wandb_sweep)[job("optimizer=adamw")]
    adafactor = summaries(wandb_sweep)[job("optimizer=adafactor")]
    [key] = [k for k in summary if "adafactor" in k and k.endswith("/memory_x_base")]
    assert summary[key] == pytest.approx(
        adafactor["mem/step_peak_bytes"] / adamw["mem/step_peak_bytes"], rel=1e-12
    )
    tables = {
        p.name.rsplit("_", 2)[0]: json.loads(p.read_text())
        for p in (run_file.parent / "files").rglob("*.table.json")
    }
    values = tables["comparison_values"]
    rows = {row[values["columns"].index("job")]: dict(zip(values["columns"], row)) for row in values["data"]}
    assert rows[job("optimizer=adamw")]["mem/optimizer_state_bytes"] == adamw["mem/optimizer_state_bytes"]
    page = tables["comparison"]  # the page's columns, numbers as numbers
    assert page["columns"][:2] == ["#", "optimizer"] and "step peak MiB x AdamW" in page["columns"]
    first = dict(zip(page["columns"], page["data"][0]))
    assert first["#"] == 1 and first["step peak MiB"] == float(
        f"{jobs_by_number(wandb_sweep)[0]['mem/step_peak_bytes'] / 2**20:.1f}"
    )


def jobs_by_number(folder):
    """The summaries in the order compare numbers the jobs (folder order)."""
    from effitrain.run.results import job_folders

    return [json.loads((f / "summary.json").read_text()) for f in job_folders(folder)]


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
def test_each_sweep_s_wandb_comparison_holds_its_own_jobs_only(wandb_sweep, tmp_path, monkeypatch):
    # compared together, two W&B sweeps share the page, but each sweep's run describes that sweep
    from effitrain.compare import load_jobs, log_to_wandb
    from effitrain.compare import wandb as wandb_table

    other = tmp_path / "other"
    shutil.copytree(wandb_sweep, other)
    logged = []
    monkeypatch.setattr(wandb_table, "log_comparison_table", lambda rows, **kw: logged.append((rows, kw)))
    jobs = load_jobs([wandb_sweep, other])
    assert len(jobs) == 4
    log_to_wandb(jobs, [wandb_sweep, other], "offline")
    assert [kw["wandb_dir"] for _, kw in logged] == [wandb_sweep, other]
    for rows, kw in logged:
        assert len(rows) == 2 and len(kw["page"][1]) == 2
        assert [row[0] for row in kw["page"][1]] == [1, 2]  # numbered within the sweep
        assert kw["summary"]["verdict/baseline"] == "AdamW"


@pytest.mark.slow
def test_several_sweep_folders_make_one_table(wandb_sweep, failing_sweep, tmp_path):
    main(["compare", str(wandb_sweep), str(failing_sweep), "--output", str(tmp_path / "report"),
          "--wandb-mode", "disabled"])  # fmt: skip
    rows = list(csv.DictReader(open(tmp_path / "report" / "comparison.csv")))
    assert sorted(row["sweep"] for row in rows) == sorted([str(wandb_sweep)] * 2 + [str(failing_sweep)] * 2)
    assert "logger" not in rows[0]  # wandb in one sweep, none in the other: run-invariant, no column
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
    all_jobs = page[page.index("<h2>All jobs</h2>") :]
    assert all_jobs[: all_jobs.index("</table>")].count("<tr") == 3  # the header and two jobs
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


@pytest.mark.slow
def test_a_sweep_over_seeds_only_is_one_combination_in_the_verdict_and_the_seeds_table(tmp_path, capsys):
    # the verdict groups as the seeds table does: the seeds are repeats, not combinations to choose from
    folder, out = swept_and_compared(tmp_path / "seeds", capsys, "logger=none", "seed=1,2")
    assert "One combination (1=2. defaults): nothing to choose between." in out
    assert "one seed per combination" not in out
    rows = list(csv.DictReader(open(folder / "comparison_seeds.csv")))
    assert [(row["combination"], row["seeds"]) for row in rows] == [("defaults", "2")]


# --- the verdict, on what real sweeps wrote ------------------------------------------------------


def _rates(folder):
    """Samples per second of each steady optimizer step, read here from metrics.jsonl on its own."""
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "train/loss" in line]
    return [
        (b["train/samples"] - a["train/samples"]) / b["speed/step_s"]
        for i, (a, b) in enumerate(zip(steps, steps[1:]), 1)
        if i >= 2  # the first two steps (warm-up) are not steady
    ]


@pytest.fixture(scope="module")
def verdict_sweep(tmp_path_factory):
    """Two optimizers, eight steps each: enough steady steps for a speed spread."""
    folder, done = sweep(tmp_path_factory.mktemp("verdict") / "sweep", "logger=none", "optimizer=adamw,adafactor",
                         "max_steps=8", "optimizer.lr=3e-3", "warmup_ratio=0")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.mark.slow
def test_the_verdict_gives_each_combination_its_ratios_against_adamw_with_their_noise(verdict_sweep, capsys):
    import statistics

    main(["compare", str(verdict_sweep)])
    terminal = capsys.readouterr().out
    by_optimizer = {
        s["cfg/optimizer"]: (s, verdict_sweep / name) for name, s in summaries(verdict_sweep).items()
    }
    adamw, adamw_dir = by_optimizer["adamw"]
    adafactor, adafactor_dir = by_optimizer["adafactor"]
    numbers = {row["optimizer"]: row["#"] for row in _markdown_rows(verdict_sweep, "# | optimizer")}
    from effitrain.compare.load import load_jobs
    from effitrain.compare.verdict import verdict

    decided = verdict(load_jobs([verdict_sweep]))
    combos = {c.label.split(" | ")[0]: c for c in decided.combos}
    memory = adafactor["mem/step_peak_bytes"] / adamw["mem/step_peak_bytes"]
    quality = adafactor["eval/loss"] / adamw["eval/loss"]
    assert combos["adafactor"].ratios["memory"].value == pytest.approx(memory, rel=1e-12)
    assert combos["adafactor"].ratios["memory"].std == 0.0  # bytes of tensors: exact
    assert combos["adafactor"].ratios["quality"].value == pytest.approx(quality, rel=1e-12)
    # one seed: the eval split's sampling error of each eval loss, combined
    sem = quality * ((adafactor["eval/loss_sem"] / adafactor["eval/loss"]) ** 2
                     + (adamw["eval/loss_sem"] / adamw["eval/loss"]) ** 2) ** 0.5  # fmt: skip
    assert combos["adafactor"].ratios["quality"].std == pytest.approx(sem, rel=1e-9)
    rates = {name: _rates(folder) for name, folder in (("adamw", adamw_dir), ("adafactor", adafactor_dir))}
    assert len(rates["adamw"]) == 6
    speed = statistics.median(rates["adafactor"]) / statistics.median(rates["adamw"])
    assert combos["adafactor"].ratios["speed"].value == pytest.approx(speed, rel=1e-9)
    assert combos["adafactor"].ratios["speed"].std > 0
    # the ratio cells, in the terminal and in comparison.md, as the verdict table gives them
    rows = {
        row["combination"].split(" \\| ")[0]: row for row in _markdown_rows(verdict_sweep, "# | combination")
    }
    assert rows["adafactor"]["#"] == numbers["adafactor"]
    assert rows["adafactor"]["step peak x AdamW"] == f"{memory:.3f}"
    assert rows["adafactor"]["eval loss x AdamW"].startswith(f"{quality:.2f} ± {sem:.2f}")
    assert rows["adafactor"]["samples/s x AdamW"].startswith(f"{speed:.2f} ± ")
    assert rows["adamw"]["step peak x AdamW"] == "1 (base)"
    assert f"{memory:.3f}" in terminal and terminal.index("Verdict") < terminal.index("opt state MiB")
    assert "one seed per combination: quality differences below the eval split's sampling error" in terminal
    # Adafactor needs less memory than AdamW, so nothing beats it; AdamW stays on the front only
    # where it is better beyond noise (two standard deviations) on quality or speed
    speed_std = combos["adafactor"].ratios["speed"].std
    adamw_better = quality - 2 * sem > 1 or speed + 2 * speed_std < 1
    front = [c.label.split(" | ")[0] for c in decided.front]
    assert memory < 1 and front == (["adafactor", "adamw"] if adamw_better else ["adafactor"])
    # the decision: first, or second after the line that says the sweep learned nothing (8 steps of
    # the tiny model may not beat a prediction that ignores the text)
    learned = not decided.lines[0].startswith("No job learned")
    decision = decided.lines[0] if learned else decided.lines[1]
    if not adamw_better:  # where it learned nothing, the choice is on memory and speed alone
        said = "Use" if learned else "On memory and speed alone, until quality can decide:"
        assert decision.startswith(f"{said} {numbers['adafactor']}. adafactor (against AdamW: ")
        assert f"{(1 - memory) * 100:.0f}% less memory" in decision
    page = (verdict_sweep / "comparison.html").read_text()
    assert page.index('class="verdict"') < page.index("All jobs") < page.index("<img")
    import html

    assert html.escape(decided.lines[0]) in page[: page.index("All jobs")]  # the decision, first


def _markdown_rows(folder, first_header):
    """The rows of the Markdown table in comparison.md whose headers start with ``first_header``."""
    lines = (folder / "comparison.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    headers = [h.strip() for h in lines[start].strip("|").split(" | ")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("*") for c in line.strip()[2:-2].split(" | ")]
        rows.append(dict(zip(headers, cells)))
    return rows


@pytest.mark.slow
def test_the_page_marks_each_columns_best_value_and_numbers_the_jobs(verdict_sweep):
    main(["compare", str(verdict_sweep), "--wandb-mode", "disabled"])
    jobs = summaries(verdict_sweep)
    rows = _markdown_rows(verdict_sweep, "# | optimizer")
    assert [row["#"] for row in rows] == ["1", "2"]
    low = min(jobs.values(), key=lambda s: s["mem/step_peak_bytes"])
    markdown = (verdict_sweep / "comparison.md").read_text()
    assert f"**{low['mem/step_peak_bytes'] / 2**20:.1f}**" in markdown
    page = (verdict_sweep / "comparison.html").read_text()
    assert f'class="num best">{low["mem/step_peak_bytes"] / 2**20:.1f}</td>' in page
    assert page.count("How to read this:") == 5  # the table and the four plots


@pytest.mark.slow
def test_a_sweep_that_learned_nothing_says_so_in_one_line(tmp_path, capsys):
    folder, out = swept_and_compared(tmp_path / "flat", capsys, "logger=none", "optimizer.lr=1e-12,2e-12")
    accuracies = {s["eval/accuracy"] for s in summaries(folder).values()}
    assert len(accuracies) == 1
    [line] = [line for line in out.splitlines() if line.startswith("No job learned anything measurable")]
    assert f"accuracy {accuracies.pop():.4f}" in line and "train longer" in line
    assert "No job learned anything measurable" in (folder / "comparison.html").read_text()


def _crowd(source, count, tmp_path):
    """``count`` copies of a real job folder, as a sweep of that many jobs whose step peaks and eval
    losses crowd together (a few coincide), the way a 24-job grid's points do."""
    crowd = tmp_path / f"crowd{count}"
    real = next(p.parent for p in sorted(source.rglob("summary.json")))
    base = json.loads((real / "summary.json").read_text())
    for i in range(count):
        job = crowd / f"optimizer.lr={i}"
        shutil.copytree(real, job, ignore=shutil.ignore_patterns(".cache", "wandb"))
        summary = dict(base, **{"job/overrides": [f"optimizer.lr={i}"],
                                "mem/step_peak_bytes": base["mem/step_peak_bytes"] * (1 + (i % 5) * 0.01),
                                "eval/loss": base["eval/loss"] * (1 + (i // 3) * 0.002)})  # fmt: skip
        (job / "summary.json").write_text(json.dumps(summary))
    return crowd


@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 6, 24])
def test_pareto_labels_never_overlap(verdict_sweep, tmp_path, count):
    from effitrain.compare.load import load_jobs
    from effitrain.compare.pareto import _overlap, plot_pareto

    jobs = load_jobs([_crowd(verdict_sweep, count, tmp_path)])
    panels = plot_pareto(jobs, tmp_path / "pareto.png")
    points = {
        (round(j.summary["mem/step_peak_bytes"] / 2**20, 3), round(j.summary["eval/loss"], 5)) for j in jobs
    }
    assert len(panels) == 2 and len(panels[0]["boxes"]) == len(points)  # one label per distinct point
    for boxes in (panel["boxes"] for panel in panels):
        for i, a in enumerate(boxes):
            assert not any(_overlap(a, b) for b in boxes[i + 1 :]), (count, a)


def test_a_summary_that_is_json_but_not_an_object_is_reported_not_raised(tmp_path, capsys):
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "summary.json").write_text("[1, 2]")  # valid JSON, not a summary
    main(["compare", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "comparison.csv")))
    assert [(row["job"], row["status"]) for row in rows] == [("listed", "missing")]
    assert "not ok: listed: missing: summary.json cannot be read (damaged)" in capsys.readouterr().out


def test_merged_curves_are_named_by_what_their_jobs_share_and_hold():
    """The name of one line standing for several identical curves (loss and lr plots)."""
    from effitrain.compare.labels import merged_label

    lion = [f"lion | seed={seed} | lr=5e-05" for seed in (42, 43, 44)]
    assert merged_label(lion) == "lion | seed=42/43/44 | lr=5e-05"
    assert merged_label(["adamw | accelerator", "adamw | trainer"]) == "adamw | accelerator/trainer"
    twelve = [f"{name} | seed={seed} | lr=0.0002" for name in ("adam8bit", "adamw", "adamw_fused", "apollo")
              for seed in (42, 43, 44)]  # fmt: skip
    assert merged_label(twelve) == "adam8bit/adamw/adamw_fused/apollo: 12 jobs"
    assert merged_label(["a" * 30 + " | x", "b" * 30 + " | y"]) == "2 jobs (named on the right)"
    assert merged_label(["adamw | seed=1", "trainer"]) == "adamw | seed=1 / trainer"


# --- the page never contradicts itself -----------------------------------------------------------


def _page_job(index, loss, sem=0.001, step_s=(2.0, 1.0, 0.1, 0.1, 0.1, 0.1), **summary):
    from pathlib import Path

    from effitrain.compare.load import JobResult

    summary = {"status": "ok", "cfg/optimizer": "adamw", "mem/step_peak_bytes": 100 * 2**20, "eval/loss": loss,
               "eval/loss_sem": sem, **summary}  # fmt: skip
    metrics = [{"step": i + 1, "train/loss": 1.0, "train/samples": 16 * (i + 1), "speed/step_s": t}
               for i, t in enumerate(step_s)]  # fmt: skip
    return JobResult(Path("s"), Path("s", f"job{index}"), summary, {}, metrics, {"lr": str(index)})


def _bold(jobs):
    """The table's bold cells by column title: the rows (1-based job numbers) marked best."""
    from effitrain.compare.table import table_best, table_rows

    headers, rows = table_rows(jobs)
    marked = table_best(jobs, headers, rows)
    return {headers[c]: {r + 1 for r, col in marked if col == c} for _, c in marked}


def test_the_table_marks_a_best_eval_loss_only_beyond_the_sampling_error():
    # 1.0973 against 1.0974, each +- 0.001: noise, nothing bold (as a 12-job sweep that learned nothing)
    assert "eval loss" not in _bold([_page_job(1, 1.0974), _page_job(2, 1.0973)])
    # 2 x hypot(0.001, 0.001) = 0.0028 < 0.05: job 2 is better beyond noise
    assert _bold([_page_job(1, 1.0974), _page_job(2, 1.0474)])["eval loss"] == {2}
    # a language model's loss beside them is of another kind: it makes neither of them best
    lm = _page_job(3, 10.29, **{"cfg/task": "causal_lm"})
    assert "eval loss" not in _bold([_page_job(1, 1.0974), _page_job(2, 1.0973), lm])
    # two within noise of each other, both beyond noise of the third: both marked
    jobs = [_page_job(1, 1.0974), _page_job(2, 0.9001), _page_job(3, 0.9000)]
    assert _bold(jobs)["eval loss"] == {2, 3}
    # samples/s, as the table shows it (the steady steps' median), marked by their spread
    steady = {1: (2, 1, 0.1, 0.1, 0.1, 0.1), 2: (2, 1, 0.2, 0.2, 0.2, 0.2)}
    assert _bold([_page_job(i, 1.0, step_s=s) for i, s in steady.items()])["samples/s"] == {1}
    noisy = {1: (2, 1, 0.1, 0.3, 0.1, 0.3), 2: (2, 1, 0.2, 0.2, 0.2, 0.2)}  # 160 +- 79 against 80 +- 0
    assert "samples/s" not in _bold([_page_job(i, 1.0, step_s=s) for i, s in noisy.items()])


def test_a_negative_first_step_overhead_is_no_figure_and_a_nan_loss_is_never_ranked():
    from effitrain.compare.table import table_rows

    jobs = [_page_job(1, float("nan"), **{"speed/first_step_overhead_s": -0.31}),
            _page_job(2, 0.9, **{"speed/first_step_overhead_s": 0.5})]  # fmt: skip
    headers, rows = table_rows(jobs)
    column = headers.index("first-step overhead s")
    assert [row[column] for row in rows] == ["", "0.50"]
    assert not jobs[0].ranked and jobs[1].ranked
    # the NaN job is the first AdamW: still not the baseline, so job 2's ratios are 1
    assert headers.count("x job 2") == 1 and rows[1][headers.index("x job 2")] == "1.000"


def test_the_memory_bar_splits_the_optimizer_state_from_the_update_s_temporaries():
    from effitrain.compare.plots import step_peak_parts

    # an Adafactor step measured on the tiny model: 0.13 MiB of state, 7.7 MiB in the tracker's category
    summary = {"mem/optimizer_state_bytes": 131884, "mem/step_peak/optimizer_state_bytes": 8067732,
               "mem/step_peak/weights_bytes": 4054028, "mem/step_peak/gradients_bytes": 4045836,
               "mem/step_peak/activations_bytes": 20, "mem/step_peak/temporaries_bytes": 0}  # fmt: skip
    parts = step_peak_parts(summary)
    assert parts["optimizer state"] == 131884
    assert parts["optimizer update temporaries"] == 8067732 - 131884
    assert sum(parts.values()) == 4054028 + 4045836 + 8067732 + 20
    del summary["mem/optimizer_state_bytes"]  # not measured: named for all it holds
    assert step_peak_parts(summary)["optimizer state and update temporaries"] == 8067732


def test_the_loss_plot_names_every_merged_group_and_keeps_close_curves_apart(tmp_path, monkeypatch):
    from effitrain.compare import plots

    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda plt, fig, path, tight=True: drawn.append(fig))
    curves = {1: [1.0, 0.9, 0.8], 2: [1.0, 0.7, 0.5], 3: [1.0, 0.9, 0.8], 4: [1.0, 0.7, 0.5],
              5: [1.0, 0.9, 0.8001]}  # fmt: skip
    jobs = []
    for index, losses in curves.items():
        job = _page_job(index, 1.0)
        job.metrics = [{"step": s, "train/loss": v, "speed/step_s": 0.1} for s, v in enumerate(losses, 1)]
        jobs.append(job)
    plots.plot_losses(jobs, tmp_path / "loss.png")
    steps_panel = drawn[0].axes[0]
    assert "one line each: 1=3, 2=4" in steps_panel.get_title().replace("\n", " ")
    lines = [line for line in steps_panel.get_lines() if not line.get_label().startswith("_")]
    assert [line.get_label().split(".")[0] for line in lines] == ["1=3", "2=4", "5"]
    # 5 nearly coincides with 1=3: each line its own style and marker, so neither hides the other
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == 3


def test_a_job_keeps_its_colour_in_every_panel_when_lines_merge_differently(tmp_path, monkeypatch):
    """Three jobs, two of them with one learning rate (two lines on the left), with three gradient
    norms (three on the right): job 3 is in the colour of its number in both panels, and in the loss
    plot, where a colour by line would give it the second colour on the left and the third elsewhere."""
    from matplotlib.colors import to_rgba

    from effitrain.compare import plots

    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda plt, fig, path, tight=True: drawn.append(fig))
    jobs = []
    for index in (1, 2, 3):
        job = _page_job(index, 1.0)
        job.metrics = [{"step": s, "train/loss": 1.0 / (s + index), "lr": 0.1 if index < 3 else 0.2,
                        "grad_norm": index * s,
                        "speed/step_s": 0.1} for s in (1, 2, 3)]  # fmt: skip
        jobs.append(job)
    plots.plot_lr_and_grad_norm(jobs, tmp_path / "lr.png")
    plots.plot_losses(jobs, tmp_path / "loss.png")
    lr_panel, norm_panel = drawn[0].axes[:2]
    colors = plots.palette(3)

    def named(ax):
        return {line.get_label().split(".")[0]: to_rgba(line.get_color()) for line in ax.get_lines()
                if not line.get_label().startswith("_")}  # fmt: skip

    assert named(lr_panel) == {"1=2": to_rgba(colors[0]), "3": to_rgba(colors[2])}
    assert named(norm_panel) == {str(i): to_rgba(colors[i - 1]) for i in (1, 2, 3)}
    assert named(drawn[1].axes[0]) == {str(i): to_rgba(colors[i - 1]) for i in (1, 2, 3)}


@pytest.mark.slow
def test_the_verdict_the_table_and_the_plots_show_the_same_speed_front_and_best(verdict_sweep, monkeypatch):
    """On a real sweep: each job's samples/s is one figure in the verdict, the All-jobs table and the
    Pareto plot (the median of its steady steps, computed here from metrics.jsonl); the front the
    verdict writes is the one the plot rings; the table's bold cells are the jobs that beat all
    others beyond noise, computed here from the summaries."""
    import statistics

    from effitrain.compare import plots
    from effitrain.run.results import job_folders

    drawn = []
    real = plots.plot_pareto
    monkeypatch.setattr(plots, "plot_pareto", lambda *a, **k: drawn.append(real(*a, **k)) or drawn[-1])
    main(["compare", str(verdict_sweep), "--wandb-mode", "disabled"])
    folders = job_folders(verdict_sweep)
    rates = [_rates(folder) for folder in folders]
    medians = [statistics.median(r) for r in rates]
    spreads = [1.4826 * statistics.median(abs(x - m) for x in r) for r, m in zip(rates, medians)]
    table = _markdown_rows(verdict_sweep, "# | optimizer")
    verdict_rows = {row["#"]: row for row in _markdown_rows(verdict_sweep, "# | combination")}
    [(memory_panel, speed_panel)] = [drawn[0]]
    for number, (median, spread) in enumerate(zip(medians, spreads), 1):
        assert table[number - 1]["samples/s"] == f"{median:.1f}"
        assert verdict_rows[str(number)]["samples/s"] == f"{median:.1f} ± {spread:.1f}"
        assert speed_panel["points"][number][1] == pytest.approx(median, rel=1e-12)
    exact = {row["job"]: row for row in csv.DictReader(open(verdict_sweep / "comparison.csv"))}
    for folder, median in zip(folders, medians):  # the CSV's exact figure beside the summary's
        assert float(exact[folder.name]["speed/steady_samples_per_s"]) == pytest.approx(median, rel=1e-12)
    front = {int(number) for number, row in verdict_rows.items() if row["front"] == "yes"}
    assert front and memory_panel["ringed"] == speed_panel["ringed"] == front
    jobs = jobs_by_number(verdict_sweep)
    best = {h: {i + 1 for i, row in enumerate(table) if f"**{row[h]}**" in _markdown_line(verdict_sweep, i)}
            for h in ("eval loss", "samples/s", "step peak MiB")}  # fmt: skip

    def beats(a, b, lower):  # the noise rule, written out here
        (x, sx), (y, sy) = a, b
        gap = (y - x) if lower else (x - y)
        return gap > max(2 * (sx**2 + sy**2) ** 0.5, 1e-3 * max(abs(x), abs(y)))

    losses = [(s["eval/loss"], s["eval/loss_sem"]) for s in jobs]
    speeds = list(zip(medians, spreads))
    peaks = [(s["mem/step_peak_bytes"], 0.0) for s in jobs]
    for header, values, lower in (("eval loss", losses, True), ("samples/s", speeds, False),
                                  ("step peak MiB", peaks, True)):  # fmt: skip
        winners = {
            i + 1 for i, v in enumerate(values) if all(beats(v, w, lower) for w in values if w is not v)
        }
        assert best[header] == winners, header
    verdict_front = {int(n) for n, row in verdict_rows.items() if row["front"] == "yes"}
    for number in range(1, len(jobs) + 1):  # a job that beats the others on every axis is alone on the front
        if all(number in best[h] for h in best):
            assert verdict_front == {number}


def _markdown_line(folder, index):
    """The ``index``-th job's line of the All-jobs table in comparison.md, with its bold marks."""
    lines = (folder / "comparison.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| # | optimizer |"))
    return lines[start + 2 + index]


def test_the_pareto_plot_shows_the_table_s_samples_per_s_and_rings_the_verdict_s_front(tmp_path):
    import statistics

    from effitrain.compare.pareto import plot_pareto
    from effitrain.compare.table import table_rows
    from effitrain.compare.verdict import verdict

    steps = {1: (2, 1, 0.1, 0.1, 0.1, 0.1), 2: (2, 1, 0.2, 0.3, 0.2, 0.2), 3: (2, 1, 0.4, 0.4, 0.4, 0.4)}
    losses = {1: 0.9, 2: 0.95, 3: 0.7}
    jobs = [_page_job(i, losses[i], **{"mem/step_peak_bytes": i * 2**20, "speed/samples_per_s": 1.0})
            for i in steps]  # fmt: skip
    for job, step_s in zip(jobs, steps.values()):
        job.metrics = [{"step": i + 1, "train/loss": 1.0, "train/samples": 16 * (i + 1), "speed/step_s": t}
                       for i, t in enumerate(step_s)]  # fmt: skip
    medians = {n: statistics.median(16 / t for t in s[2:]) for n, s in steps.items()}
    memory_panel, speed_panel = plot_pareto(jobs, tmp_path / "pareto.png")
    assert {n: y for n, (_, y) in speed_panel["points"].items()} == pytest.approx(medians, rel=1e-12)
    headers, rows = table_rows(jobs)
    assert [row[headers.index("samples/s")] for row in rows] == [f"{medians[n]:.1f}" for n in steps]
    # job 1: least memory and fastest; job 3: lowest loss: the front is 1 and 3, job 2 is beaten by 1
    assert memory_panel["ringed"] == speed_panel["ringed"] == verdict(jobs).front_numbers == {1, 3}
