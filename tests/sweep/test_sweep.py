"""Sweeps as a user runs them: one process per job, predictable folders, failures counted, resume."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from effitrain.config.errors import ConfigError
from effitrain.config.load import apply_effective_batch_size
from effitrain.config.registry import check_group_overrides
from effitrain.config.validate import validate
from effitrain.sweep.launcher import LAUNCHER_DIR, LAUNCHES
from tests.helpers.run import REPO, TINY, compose, train_py, wait_for_lines

# Each job starts its own Python (about 3 s of imports here), so jobs are few and short.
SHORT = ["max_steps=2", "data.num_train=32", "data.num_eval=16"]
# TINY's overrides that change results (the others are run-invariant: out of job/overrides)
TINY_RESULT_OVERRIDES = [o for o in TINY if not o.startswith(("progress_bar=", "logger="))]


def _summaries(sweep_dir):
    return {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("*/summary.json")}


def _launches(sweep_dir) -> list[dict]:
    """The launcher's record of the jobs it started (or settled without a process), in order."""
    path = sweep_dir / LAUNCHER_DIR / LAUNCHES
    return [json.loads(line) for line in path.read_text().splitlines()]


def _started_pids(lines: list[str]) -> list[int]:
    return [
        int(line.split("(pid ")[1].split(",")[0].split(")")[0]) for line in lines if "started (pid" in line
    ]


def _start_sweep(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_job_killed_mid_sweep_is_recorded_the_others_finish_and_a_rerun_repeats_only_it(tmp_path):
    args = ["-m", *TINY, *SHORT, "seed=1,2,3", f"hydra.sweep.dir={tmp_path}"]
    sweep = _start_sweep(*args)
    lines = wait_for_lines(sweep, "started (pid", 2)
    victim = _started_pids(lines)[1]
    # killed once Hydra has handed it the task (it then imports torch, builds, trains: seconds),
    # as the OOM killer would kill it
    record = next(tmp_path.glob("*seed=2")) / ".hydra" / "config.yaml"
    deadline = time.time() + 300
    while not record.exists() and time.time() < deadline and sweep.poll() is None:
        time.sleep(0.01)
    os.kill(victim, signal.SIGKILL)
    out, err = sweep.communicate(timeout=600)
    assert sweep.returncode == 1, out[-3000:] + err[-3000:]
    assert "effitrain: 1 of 3 jobs failed (0 skipped: ok before)" in out
    before = _summaries(tmp_path)
    by_seed = {s["cfg/seed"]: s for s in before.values()}
    assert (by_seed[2]["status"], by_seed[2]["signal"]) == ("killed", signal.SIGKILL)
    assert by_seed[2]["job/overrides"] == sorted([*TINY_RESULT_OVERRIDES, *SHORT, "seed=2"])
    assert by_seed[1]["status"] == by_seed[3]["status"] == "ok"

    rerun = train_py(*args)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "effitrain: 0 of 3 jobs failed (2 skipped: ok before)" in rerun.stdout
    started = [line for line in _launches(tmp_path)[3:] if line.get("pid")]
    assert [line["folder"].endswith("seed=2") for line in started] == [True]
    after = {s["cfg/seed"]: s for s in _summaries(tmp_path).values()}
    assert after[2]["status"] == "ok" and after[2]["env/pid"] == started[0]["pid"]
    assert after[1] == by_seed[1] and after[3] == by_seed[3]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_to_a_sweep_interrupts_every_running_job(tmp_path, signum):
    # long jobs (stopped anyway): two at once, both training when the signal comes
    args = ["-m", *TINY, "data.num_train=64", "epochs=200", "seed=1,2,3", "hydra.launcher.max_parallel=2"]
    sweep = _start_sweep(*args, f"hydra.sweep.dir={tmp_path}")
    pids = _started_pids(wait_for_lines(sweep, "started (pid", 2))
    deadline = time.time() + 300
    while len(list(tmp_path.glob("*/metrics.jsonl"))) < 2 and time.time() < deadline:
        time.sleep(0.05)
    sweep.send_signal(signum)
    out, err = sweep.communicate(timeout=300)
    assert sweep.returncode == 128 + signum, out[-3000:] + err[-3000:]
    assert "Traceback" not in err
    summaries = {s["cfg/seed"]: s for s in _summaries(tmp_path).values()}
    assert sorted(summaries) == [1, 2]  # the third never started
    for summary in summaries.values():
        # written by each run itself: how far it got, and the signal
        assert (summary["status"], summary["signal"]) == ("interrupted", signum)
        assert summary["train/steps"] >= 1
    assert "1 not started" in out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_plain_multirun_runs_each_job_in_its_own_process(tmp_path):
    result = train_py(
        "-m",
        *TINY,
        *SHORT,
        "optimizer=adamw,adafactor",
        "backend=accelerator,trainer",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = _summaries(tmp_path)
    # one folder per job, named from its overrides (progress_bar and logger are left out of names)
    common = "data.num_eval=16,data.num_train=32,data=synthetic,epochs=1,eval_batch_size=32,max_steps=2"
    assert set(summaries) == {
        f"backend={b},{common},micro_batch_size=8,model=tiny,optimizer={o}"
        for b in ("accelerator", "trainer")
        for o in ("adamw", "adafactor")
    }
    assert [s["status"] for s in summaries.values()] == ["ok"] * 4
    pids = {s["env/pid"] for s in summaries.values()}
    assert len(pids) == 4 and os.getpid() not in pids
    assert {(s["cfg/optimizer"], s["cfg/backend"]) for s in summaries.values()} == {
        (o, b) for o in ("adamw", "adafactor") for b in ("accelerator", "trainer")
    }
    assert all(s["train/steps"] == 2 for s in summaries.values())
    assert "effitrain: 0 of 4 jobs failed (0 skipped: ok before)" in result.stdout
    for name, summary in summaries.items():
        # each job's output in its own folder, named in the report's line for it
        log = tmp_path / name / "job.log"
        # no lock file, no empty train.log, no empty trainer/ folder left
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [".hydra", "job.log", "metrics.jsonl",
                                                                        "summary.json"]  # fmt: skip
        assert f"effitrain: ok: train/loss {summary['train/loss']:.4f}" in log.read_text()
        assert f"effitrain: ok: {name} (log: {log})" in result.stdout
        # start-up: process creation to the first step, within the job's process lifetime
        assert 0 < summary["speed/startup_s"] < 300
        assert summary["env/cpu_affinity"] == sorted(os.sched_getaffinity(0))  # one at a time: all cores


def _split(summary: dict) -> str:
    (override,) = [o for o in summary["job/overrides"] if o.startswith("data.eval_split=")]
    return override.split("=")[1]


@pytest.mark.slow
def test_failed_job_is_counted_others_finish_and_a_rerun_redoes_only_it(tmp_path, tmp_path_factory):
    # a label missing from one eval file is found only when that job reads its data: only that job
    # fails, in its own process (a value validate() rejects stops the whole sweep before it starts);
    # two jobs run at once, each with its own device and cores, which also keeps this test short.
    def write(name, count, missing_label=False):
        rows = [(f"the {'good' if i % 2 else 'bad'} one {i}", i % 2) for i in range(count)]
        lines = [
            f"{text},{'' if missing_label and i == count - 1 else label}"
            for i, (text, label) in enumerate(rows)
        ]
        (data / f"{name}.csv").write_text("text,label\n" + "\n".join(lines) + "\n")

    data = tmp_path_factory.mktemp("csv")
    for name, count in (("train", 32), ("e16", 16), ("e24", 24)):
        write(name, count)
    write("e0", 8, missing_label=True)
    files = ", ".join(f"{n}: {data}/{n}.csv" for n in ("train", "e16", "e24", "e0"))
    args = [
        "-m",
        *[o for o in TINY if o != "data=synthetic"],
        "data=hub",
        "data.load_args.path=csv",
        f"+data.load_args.data_files={{{files}}}",
        "max_steps=2",
        "data.eval_split=e16,e24,e0",
        "hydra.launcher.max_parallel=2",
        "hydra.launcher.devices=[0,1]",
        f"hydra.sweep.dir={tmp_path}",
    ]
    first = train_py(*args)
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]
    assert "effitrain: 1 of 3 jobs failed (0 skipped: ok before)" in first.stdout
    before = _summaries(tmp_path)
    # folder names this long are shortened with a hash: each job's eval split is read from its summary
    split_of = {name: _split(s) for name, s in before.items()}
    by_length = {split_of[name][1:]: s for name, s in before.items()}
    assert by_length["0"]["status"] == "failed"
    assert "a label is missing: every sample needs one" in by_length["0"]["error"]
    assert by_length["16"]["status"] == by_length["24"]["status"] == "ok"
    # the devices and cores each job was given are in its summary; jobs running at once share none
    launched = {line["pid"]: line for line in _launches(tmp_path)}
    for summary in (by_length["16"], by_length["24"]):
        line = launched[summary["env/pid"]]
        assert summary["env/cuda_visible_devices"] == line["cuda_visible_devices"] in ("0", "1")
        assert summary["env/cpu_affinity"] == line["cpus"]
        assert summary["env/num_threads"] == len(line["cpus"])
    lines = list(launched.values())
    for a in lines:
        for b in lines:
            if a is not b and a["started"] < b["ended"] and b["started"] < a["ended"]:
                assert a["cuda_visible_devices"] != b["cuda_visible_devices"]
                assert not set(a["cpus"]) & set(b["cpus"]) or len(os.sched_getaffinity(0)) < 2
    mtimes = {name: (tmp_path / name / "summary.json").stat().st_mtime_ns for name in before}

    second = train_py(*args)
    assert second.returncode == 1
    assert "effitrain: 1 of 3 jobs failed (2 skipped: ok before)" in second.stdout
    assert second.stdout.count("effitrain: ok (skipped: ok before):") == 2
    after = _summaries(tmp_path)
    for name, summary in after.items():
        rerun = split_of[name] == "e0"
        assert (summary["env/pid"] != before[name]["env/pid"]) == rerun
        assert ((tmp_path / name / "summary.json").stat().st_mtime_ns != mtimes[name]) == rerun

    from effitrain.cli import main

    main(["compare", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "comparison.csv")))
    assert sorted((row["data.eval_split"], row["status"]) for row in rows) == [
        ("e0", "failed"),
        ("e16", "ok"),
        ("e24", "ok"),
    ]
    failed = next(row for row in rows if row["status"] == "failed")
    assert failed["error"] == by_length["0"]["error"]
    assert "failed" in (tmp_path / "comparison.md").read_text()


def test_named_studies_are_multiruns_over_their_choices():
    expected = {
        "optimizers": {"optimizer": "adamw,adafactor,adam8bit", "backend": "trainer,accelerator"},
        "accumulation": {"gradient_accumulation_steps": "1,2,4,8"},
        "compile": {"compile": "off,on", "backend": "trainer,accelerator"},
        "grid": {
            "optimizer": "adamw,adafactor,adam8bit",
            "gradient_accumulation_steps": "1,4",
            "compile": "off,on",
            "backend": "trainer,accelerator",
        },
    }
    for name, params in expected.items():
        cfg = compose(f"sweep={name}")
        assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
        assert OmegaConf.to_container(cfg.hydra.sweeper.params) == params
        assert cfg.hydra.sweep.dir.startswith(f"multirun/{name}/")
        assert cfg.hydra.launcher._target_.endswith("effitrain_launcher.EffitrainLauncher")
        assert cfg.hydra.launcher.timeout_min == 1440
        assert cfg.hydra.launcher.max_parallel == 1  # one job at a time unless asked
        assert cfg.hydra.sweeper.max_batch_size is None  # all jobs to the launcher, which paces them
    assert compose().hydra.mode is None  # no study: one run, as before
    assert (REPO / "conf" / "sweep").resolve() == REPO / "multirun_sweeps"


def test_unknown_study_is_one_line():
    with pytest.raises(
        ConfigError,
        match="sweep='typo' is not an option: choose one of accumulation, adapters, adapters_lm, checkpointing, compile, grid",
    ):
        check_group_overrides(["sweep=typo"])


@pytest.mark.parametrize("study", ["accumulation", "grid"])
def test_accumulation_jobs_share_one_effective_batch(study):
    swept = OmegaConf.load(REPO / "multirun_sweeps" / f"{study}.yaml").hydra.sweeper.params
    micro = {}
    for steps in str(swept.gradient_accumulation_steps).split(","):
        # as a job of the study composes it: no micro_batch_size override from the tiny test preset
        cfg = compose(
            "model=tiny",
            "data=synthetic",
            f"sweep={study}",
            f"gradient_accumulation_steps={steps}",
            tiny=False,
        )
        validate(cfg)
        apply_effective_batch_size(cfg)
        micro[int(steps)] = cfg.micro_batch_size
    assert {steps * m for steps, m in micro.items()} == {32}
    assert micro == ({1: 32, 2: 16, 4: 8, 8: 4} if study == "accumulation" else {1: 32, 4: 8})


def test_accumulation_that_does_not_divide_names_the_keys():
    cfg = compose(
        "sweep=accumulation", "effective_batch_size=30", "gradient_accumulation_steps=4", tiny=False
    )
    with pytest.raises(
        ConfigError,
        match=r"^effective_batch_size=30 is invalid: must be a multiple of gradient_accumulation_steps x processes = 4",
    ):
        validate(cfg)
    cfg = compose(
        "sweep=accumulation", "effective_batch_size=32", "gradient_accumulation_steps=4", tiny=False
    )
    validate(cfg, world_size=2)  # two processes: 32 / (4 x 2) = 4 samples per micro-batch
    apply_effective_batch_size(cfg, world_size=2)
    assert cfg.micro_batch_size == 4
    with pytest.raises(ConfigError, match=r"x processes = 12,"):
        validate(cfg, world_size=3)


def test_job_shares_the_sweep_compile_cache_and_skips_only_ok_summaries(tmp_path, monkeypatch, capsys):
    from effitrain.run.results import write_json_atomic
    from effitrain.sweep.worker import INDUCTOR_CACHE, start_job

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    job = tmp_path / "optimizer=adamw"
    hydra_cfg = OmegaConf.create({"sweep": {"dir": str(tmp_path)}, "runtime": {"output_dir": str(job)}})
    from effitrain.run.folder_policy import CONFIG_KEY, config_record
    from tests.helpers.run import compose

    cfg = compose()
    assert start_job(cfg, hydra_cfg) is None  # nothing there yet
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path.resolve() / INDUCTOR_CACHE)

    write_json_atomic(job / "summary.json", {"status": "failed", "error": "x"})
    assert start_job(cfg, hydra_cfg) is None
    finished = {"status": "ok", "eval/loss": 0.5, CONFIG_KEY: config_record(cfg)}  # as a run writes it
    write_json_atomic(job / "summary.json", finished)
    assert start_job(cfg, hydra_cfg) == finished
    assert f"effitrain: skip: {job} already holds an ok summary.json" in capsys.readouterr().out
    assert start_job(OmegaConf.merge(cfg, {"skip_ok_jobs": False}), hydra_cfg) is None


@pytest.mark.slow
def test_a_rerun_skips_a_job_only_when_it_ran_the_same_config(tmp_path):
    """A plain -m gradient_accumulation_steps=1,2 sweep (effective batch 16 x accumulation), then
    sweep=accumulation (effective batch fixed at 32) into the same folder: the folders have the same
    names, but the ok runs in them ran another effective batch, so the sweep is refused up front,
    naming the job and the key; the same sweep again skips both jobs."""
    common = ["model=tiny", "data=synthetic", "data.num_train=32", "epochs=1", "max_steps=1", "eval_batch_size=32",
              "progress_bar=false", "logger=none", f"hydra.sweep.dir={tmp_path}"]  # fmt: skip
    first = train_py("-m", *common, "gradient_accumulation_steps=1,2")
    assert first.returncode == 0, first.stderr[-2000:]
    summaries = {p.parent.name: json.loads(p.read_text()) for p in tmp_path.rglob("summary.json")}
    assert sorted(s["cfg/effective_batch_size"] for s in summaries.values()) == [16, 32]
    again = train_py("-m", *common, "gradient_accumulation_steps=1,2")
    assert again.returncode == 0 and "(2 skipped: ok before)" in again.stdout
    study = train_py("-m", *common, "sweep=accumulation")
    assert study.returncode == 2
    lines = [line for line in study.stderr.splitlines() if line.startswith("effitrain: error:")]
    assert lines[0] == "effitrain: error: the sweep's job gradient_accumulation_steps=1:"
    assert lines[1].startswith("effitrain: error: effective_batch_size=32 is invalid: ")
    assert "holds an ok run with effective_batch_size=None, which this sweep would skip as done" in lines[1]
    after = {p.parent.name: json.loads(p.read_text()) for p in tmp_path.rglob("summary.json")}
    assert after == summaries


@pytest.mark.slow
def test_a_job_whose_folder_holds_another_config_s_ok_run_is_failed_never_reported_ok(tmp_path):
    """Past preflight (here: a job after the first MAX_JOBS_CHECKED, which it leaves to the launcher;
    --config-dir/--config-name go through the preflight, which refuses it up front), the launcher
    itself compares the recorded config; and a job whose run refuses its ok folder is failed, not
    read back as ok."""
    alt = tmp_path / "conf"
    alt.mkdir()
    (alt / "alt.yaml").write_text("defaults:\n  - config\n  - _self_\nweight_decay: 0.123\n")
    sweep = tmp_path / "sweep"
    common = ["-m", *TINY, "data.num_train=32", "max_steps=1", "seed=1", f"hydra.sweep.dir={sweep}"]
    first = train_py(*common)
    assert first.returncode == 0, first.stderr[-2000:]
    [(name, before)] = _summaries(sweep).items()
    flags = ["--config-dir", str(alt), "--config-name", "alt"]
    refused = train_py(*common, *flags)
    assert refused.returncode == 2 and _summaries(sweep) == {name: before}, refused.stderr[-2000:]
    code = "import sys, effitrain.commands.train_command as c\nc.MAX_JOBS_CHECKED = 0\nc.train(sys.argv[1:])"
    command = [sys.executable, "-c", code, *common, *flags]
    changed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert changed.returncode == 1, changed.stdout[-2000:] + changed.stderr[-2000:]
    assert "effitrain: 1 of 1 jobs failed (0 skipped: ok before)" in changed.stdout
    assert (
        f"effitrain: failed: {name}: weight_decay=0.123 is invalid: {sweep / name} holds an ok run with "
        "weight_decay=0.01, which this sweep would skip as done: give another hydra.sweep.dir"
    ) in changed.stdout
    rerun = train_py(*common, "skip_ok_jobs=false")
    assert rerun.returncode == 1, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert f"effitrain: failed: {name}: ConfigError: hydra.run.dir=" in rerun.stdout
    assert "it holds a finished ok run (summary.json)" in rerun.stdout
    assert _summaries(sweep) == {name: before}  # the ok result is kept as it was
