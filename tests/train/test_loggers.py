"""W&B logging, read back offline with wandb's own reader (``wandb leet inspect --json``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from effitrain.compare import wandb as wandb_table
from effitrain.config.errors import ConfigError
from effitrain.train import loggers
from tests.helpers.run import TINY, compose, read_metrics, run_job, train_py

FEW_STEPS = ["max_steps=3", "data.num_train=48", "data.num_eval=16"]
WANDB = ["logger=wandb", "logger.mode=offline"]
TINY_WANDB = [o for o in TINY if not o.startswith("logger=")] + FEW_STEPS + ["logger=wandb"]


def wandb_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).rglob("*.wandb"))


def inspect_records(path: Path) -> list[dict]:
    """Every record of a ``.wandb`` log, as wandb's own reader prints them."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def inspect_summary(path: Path) -> dict:
    """The run's state, config, summary and exit code (``wandb leet inspect --summary --json``)."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(path)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout)


def run_record(records: list[dict]) -> dict:
    return next(r["run"] for r in records if r["type"] == "run")


def history(records: list[dict]) -> list[dict]:
    return [r["history"]["item"] for r in records if r["type"] == "history"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_offline_run_holds_config_history_and_summary_of_the_result_files(tmp_path, backend, capsys):
    summary = run_job(tmp_path, *WANDB, f"backend={backend}", "optimizer.lr=3e-4", *FEW_STEPS)
    assert summary["status"] == "ok", summary["error"]
    [log_file] = wandb_files(tmp_path / "wandb")  # the W&B run lives in the job's folder
    state = inspect_summary(log_file)
    assert state["state"] == "finished" and state["exit_code"] == 0 and state["project"] == "effitrain"

    config = state["config"]  # resolved, plain values and the cfg/* keys of summary.json
    assert config["optimizer"]["lr"] == 3e-4 and config["optimizer"]["betas"] == [0.9, 0.999]
    assert config["max_steps"] == 3 and config["data"]["num_train"] == 48
    assert config["cache_dir"] == str(Path(config["cache_dir"]))  # ${oc.env:...} resolved
    assert "${" not in json.dumps(config) and "hydra" not in config
    for key in ("cfg/optimizer", "cfg/backend", "cfg/effective_batch_size", "cfg/lr", "cfg/seed"):
        assert config[key] == summary[key]

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for key, value in on_disk.items():  # W&B drops null summary values
        assert state["summary"].get(key) == value, key
    assert state["summary"]["status"] == "ok" and state["summary"]["train/steps"] == 3

    records = inspect_records(log_file)
    rows, lines = history(records), read_metrics(tmp_path, kind="all")
    # three optimizer steps, then the final evaluation's line
    assert [row["step"] for row in rows] == [line["step"] for line in lines] == [1, 2, 3, 3]
    for row, line in zip(rows, lines):
        assert {k: row.get(k) for k in line} == line  # same keys, same numbers as metrics.jsonl
    assert {"glob_name": "*", "options": {"defined": True, "step_sync": True}, "step_metric": "step"} in [
        r["metric"] for r in records if r["type"] == "metric"
    ]

    run = run_record(records)
    assert run["job_type"] == backend and "run_group" not in run  # a single run has no sweep
    # a short name for the dashboard; the full overrides (run-invariant ones left out) in the config
    assert run["display_name"] == summary["job/name"]
    assert summary["job/name"] == (
        f"tiny | synthetic | epochs=1 | mb8 | eval_batch_size=32 | {backend} | lr=0.0003 | max_steps=3"
        " | num_train=48 | num_eval=16"
    )
    overrides = TINY + [f"backend={backend}", "optimizer.lr=3e-4"] + FEW_STEPS  # logger.* left out
    assert (
        config["job/overrides"]
        == summary["job/overrides"]
        == sorted(o for o in overrides if not o.startswith(("progress_bar", "logger")))
    )
    assert run["tags"] == [f"backend={backend}", "data=synthetic", "model=tiny"]  # the swapped groups
    # one line saying how to upload, at the start and again at the end, where it does not scroll away
    lines = capsys.readouterr().out.splitlines()
    hints = [i for i, line in enumerate(lines) if "wandb sync" in line]
    assert len(hints) == 2 and lines[hints[0]] == lines[hints[1]]
    assert hints[0] < lines.index(next(line for line in lines if "training: " in line)) < hints[1]


@pytest.mark.slow
def test_two_job_multirun_in_one_process_gives_two_runs_in_one_group(tmp_path):
    sweep = tmp_path / "sweep"
    marker = "effitrain-marker-key-0a1b2c3d4e5f60718293a4b5c6d7e8f9"  # WANDB_MODE=offline comes from conftest
    proc = train_py(
        "-m",
        *TINY_WANDB,
        "optimizer=adamw,adafactor",
        "hydra/launcher=basic",  # both jobs in this one process
        f"hydra.sweep.dir={sweep}",
        env={"WANDB_API_KEY": marker},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = [p for p in sweep.rglob("*") if p.is_file()]  # Hydra's files, logs, W&B runs: no key anywhere
    assert len(written) > 20 and [p for p in written if marker.encode() in p.read_bytes()] == []
    files = wandb_files(sweep / "wandb")  # every job's run in the sweep's own W&B folder
    assert len(files) == 2 and wandb_files(sweep) == files
    runs = [run_record(inspect_records(f)) for f in files]
    assert len({run["run_id"] for run in runs}) == 2
    # the study and its start time (here the folder's last two parts), the full folder in the config
    assert {run["run_group"] for run in runs} == {f"{tmp_path.name}/sweep"}
    assert sorted(run["tags"][-1] for run in runs) == ["optimizer=adafactor", "optimizer=adamw"]
    assert sorted(run["display_name"].endswith("adafactor") for run in runs) == [False, True]
    for f in files:
        state = inspect_summary(f)
        job = next(
            p.parent
            for p in sweep.glob("*/summary.json")
            if f"optimizer={state['summary']['cfg/optimizer']}" in p.parent.name
        )
        assert state["exit_code"] == 0 and state["summary"] == {**state["summary"], **_non_null(job)}
        assert state["config"]["job/sweep_dir"] == str(sweep)
        assert [row["step"] for row in history(inspect_records(f))] == [
            line["step"] for line in read_metrics(job, kind="all")
        ]
    # one upload line for the whole sweep, at its end
    lines = proc.stdout.splitlines()
    sync_lines = [line for line in lines if "wandb sync" in line]
    assert sync_lines == [
        f"effitrain: W&B runs saved offline; upload them with: wandb sync {sweep}/wandb/offline-run-*"
    ]
    assert lines.index(sync_lines[0]) > max(i for i, line in enumerate(lines) if "jobs failed" in line)


def _non_null(job_dir: Path) -> dict:
    return {k: v for k, v in json.loads((job_dir / "summary.json").read_text()).items() if v is not None}


def test_a_failed_job_finishes_its_run_with_a_nonzero_exit_code(tmp_path, monkeypatch):
    from effitrain.backends import accelerator

    def broken_fit(job):
        job.meter.start()
        raise RuntimeError("the loop broke")

    monkeypatch.setattr(accelerator, "fit", broken_fit)
    summary = run_job(tmp_path, *WANDB, *FEW_STEPS)
    assert summary["status"] == "failed"
    state = inspect_summary(wandb_files(tmp_path)[0])
    assert state["exit_code"] == 1 and state["state"] == "failed"
    assert state["summary"]["status"] == "failed" and "the loop broke" in state["summary"]["error"]


@pytest.mark.slow
def test_an_interrupted_job_finishes_its_run_as_crashed(tmp_path, monkeypatch):
    from effitrain.backends import accelerator

    def interrupted_fit(job):
        raise KeyboardInterrupt

    monkeypatch.setattr(accelerator, "fit", interrupted_fit)
    summary = run_job(tmp_path, *WANDB, *FEW_STEPS)
    assert (summary["status"], summary["signal"], summary["error"]) == (
        "interrupted",
        2,
        "interrupted by SIGINT",
    )
    state = inspect_summary(wandb_files(tmp_path)[0])
    assert state["exit_code"] == 1 and state["state"] == "failed"
    assert state["summary"]["status"] == "interrupted"


@pytest.mark.slow
def test_the_w_and_b_config_holds_the_derived_micro_batch(tmp_path):
    """With ``effective_batch_size`` set, the W&B run's config holds the micro batch the run trains
    with (derived before the W&B run starts), not the config file's."""
    overrides = [o for o in TINY if not o.startswith(("micro_batch_size=", "logger="))]
    batch = ["effective_batch_size=16", "gradient_accumulation_steps=2"]
    assert compose(*overrides, tiny=False).micro_batch_size == 16  # the file's value, before deriving
    summary = run_job(tmp_path, *overrides, *WANDB, *FEW_STEPS, *batch, tiny=False)
    assert summary["status"] == "ok" and summary["cfg/micro_batch_size"] == 8
    assert summary["train/samples"] == 3 * 16  # 3 steps of 2 micro-batches of 8
    config = inspect_summary(wandb_files(tmp_path)[0])["config"]
    assert config["micro_batch_size"] == 8 and config["cfg/micro_batch_size"] == 8


@pytest.mark.slow
def test_a_rejected_config_shows_as_crashed_too(tmp_path):
    summary = run_job(tmp_path, *WANDB, "gradient_accumulation_steps=0")
    assert summary["status"] == "failed" and summary["error_type"] == "config"
    state = inspect_summary(wandb_files(tmp_path)[0])
    assert state["exit_code"] == 1 and "gradient_accumulation_steps=0" in state["summary"]["error"]


@pytest.mark.slow
def test_the_api_key_is_written_to_no_file(tmp_path, monkeypatch):
    marker = "effitrain-marker-key-5f3c9a1e7d2b4c6a8e0f1a2b3c4d5e6f70819a2b"  # 40+ chars, as a real key
    monkeypatch.setenv("WANDB_API_KEY", marker)
    # even a config that pulls the key in by interpolation does not leak it to the W&B config
    summary = run_job(tmp_path, *WANDB, "+logger.notes=${oc.env:WANDB_API_KEY}", *FEW_STEPS)
    assert summary["status"] == "ok", summary["error"]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(wandb_files(tmp_path)) == 1 and len(files) > 5
    leaks = [p for p in files if marker.encode() in p.read_bytes()]
    assert leaks == []
    assert inspect_summary(wandb_files(tmp_path)[0])["config"]["logger"]["notes"] == "<redacted>"


@pytest.mark.slow
def test_wandb_init_raising_never_fails_training(tmp_path, monkeypatch, capsys):
    import wandb

    def unreachable(**kwargs):
        raise wandb.errors.CommError("could not reach the server")

    monkeypatch.setattr(wandb, "init", unreachable)
    summary = run_job(tmp_path, *WANDB, *FEW_STEPS)
    assert summary["status"] == "ok", summary["error"]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "ok"
    assert len(read_metrics(tmp_path)) == 3
    warnings = [line for line in capsys.readouterr().err.splitlines() if "W&B" in line]
    assert len(warnings) == 1 and "could not reach the server" in warnings[0]


@pytest.mark.slow
def test_wandb_not_importable_never_fails_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    summary = run_job(tmp_path, *WANDB, *FEW_STEPS)
    assert summary["status"] == "ok", summary["error"]
    assert wandb_files(tmp_path) == []
    assert sum("W&B" in line for line in capsys.readouterr().err.splitlines()) == 1


@pytest.mark.slow
def test_online_init_failing_falls_back_to_offline(tmp_path, monkeypatch):
    import wandb

    real_init = wandb.init

    def offline_only(**kwargs):
        if kwargs["mode"] == "online":
            raise TimeoutError("no answer from api.wandb.ai")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", offline_only)
    summary = run_job(tmp_path, "logger=wandb", "logger.mode=online", *FEW_STEPS)
    assert summary["status"] == "ok", summary["error"]
    [log_file] = wandb_files(tmp_path)
    assert len(history(inspect_records(log_file))) == 3 + 1  # the steps and the final evaluation


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["logger=none"], ["logger=wandb", "logger.mode=disabled"]])
def test_no_wandb_files_when_off(tmp_path, overrides):
    summary = run_job(tmp_path, *overrides, *FEW_STEPS)
    assert summary["status"] == "ok", summary["error"]
    assert not (tmp_path / "wandb").exists() and len(read_metrics(tmp_path)) == 3


def test_mode_is_offline_without_credentials_and_online_with_them(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login user password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert loggers.resolve_mode(None) == "offline"
    netrc.write_text("machine api.wandb.ai login user password secret\n")
    assert loggers.resolve_mode(None) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert loggers.resolve_mode(None) == "offline"
    assert loggers.resolve_mode("disabled") == "disabled"  # logger.mode wins over everything
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert loggers.resolve_mode(None) == "online"
    with pytest.raises(ConfigError, match=r"^logger.mode='cloud' is invalid: choose one of online, offline"):
        loggers.resolve_mode("cloud")


def test_comparison_table_is_its_own_run_of_the_group(tmp_path):
    rows = [
        {"job": 0, "cfg/optimizer": "adamw", "mem/step_peak_bytes": 123_456_789, "eval/loss": 0.75},
        {"job": 1, "cfg/optimizer": "adam8bit", "mem/step_peak_bytes": 98_765_432, "eval/loss": float("nan")},
        {"job": 2, "cfg/optimizer": "adafactor", "status": "oom"},
    ]
    folder = wandb_table.log_comparison_table(
        rows, group="multirun/2025-01-31/12-00-00", wandb_dir=tmp_path, mode="offline"
    )
    [log_file] = wandb_files(tmp_path)
    assert Path(folder) == log_file.parent
    run = run_record(inspect_records(log_file))
    assert run["run_group"] == "multirun/2025-01-31/12-00-00" and run["job_type"] == "compare"
    [table_file] = (log_file.parent / "files").rglob("comparison_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["job", "cfg/optimizer", "mem/step_peak_bytes", "eval/loss", "status"]
    assert table["data"] == [
        [0, "adamw", 123_456_789, 0.75, None],
        [1, "adam8bit", 98_765_432, None, None],
        [2, "adafactor", None, None, "oom"],
    ]
    assert inspect_summary(log_file)["summary"]["jobs"] == 3


def test_comparison_rows_of_differently_shaped_values_are_one_table(tmp_path, capsys):
    """Two optimizers' summaries: ``job/config`` dicts with other keys, a column of text beside
    numbers, a page cell a job lacks. W&B's Table refused such rows (the whole comparison, verdict
    included, never reached the run); now nested values are their JSON text and a mixed column text."""
    rows = [
        {"job": "a", "lr": "0.0002", "job/config": {"optimizer.betas": [0.9, 0.999]}, "env/cpu_affinity": [0, 1]},
        {"job": "b", "lr": 3e-4, "job/config": {"optimizer.clip_threshold": 1.0}, "env/cpu_affinity": [0, 1]},
    ]  # fmt: skip
    page = (["#", "optimizer", "step peak MiB"], [[1.0, "adamw", 22.9], [2.0, "adafactor", None]])
    folder = wandb_table.log_comparison_table(
        rows, group="g", wandb_dir=tmp_path, mode="offline", page=page, summary={"verdict": "use adamw"}
    )
    assert "W&B" not in capsys.readouterr().err
    tables = {p.name.rsplit("_", 2)[0]: json.loads(p.read_text()) for p in Path(folder).rglob("*.table.json")}
    assert tables["comparison_values"]["data"] == [
        ["a", "0.0002", '{"optimizer.betas": [0.9, 0.999]}', "[0, 1]"],
        ["b", "0.0003", '{"optimizer.clip_threshold": 1.0}', "[0, 1]"],
    ]
    assert tables["comparison"]["data"] == [[1, "adamw", 22.9], [2, "adafactor", None]]
    [log_file] = wandb_files(tmp_path)
    state = inspect_summary(log_file)
    assert state["exit_code"] == 0 and state["summary"]["verdict"] == "use adamw"
    assert state["summary"]["jobs"] == 2


def test_a_table_wandb_refuses_leaves_the_verdict_in_a_run_finished_as_failed(tmp_path, monkeypatch, capsys):
    import wandb

    def refuse(*args, **kwargs):
        raise TypeError("Data row contained incompatible types:\n{'job': ...} of type {...}")

    monkeypatch.setattr(wandb, "Table", refuse)
    folder = wandb_table.log_comparison_table(
        [{"job": "a"}], group="g", wandb_dir=tmp_path, mode="offline", summary={"verdict": "use adamw"}
    )
    assert folder is None
    [warning] = [line for line in capsys.readouterr().err.splitlines() if "W&B" in line]
    assert warning == (
        "effitrain: warning: W&B: the comparison table was not logged "
        "(TypeError: Data row contained incompatible types:)"
    )
    state = inspect_summary(wandb_files(tmp_path)[0])
    assert (state["state"], state["exit_code"]) == ("failed", 1)  # finished, as failed: not left open
    assert state["summary"]["jobs"] == 1 and state["summary"]["verdict"] == "use adamw"


def test_comparison_table_disabled_writes_nothing(tmp_path):
    assert (
        wandb_table.log_comparison_table([{"job": 0}], group="g", wandb_dir=tmp_path, mode="disabled") is None
    )
    assert list(tmp_path.iterdir()) == []


def test_wandb_is_the_default_logger_and_builds_a_logger(tmp_path, monkeypatch):
    cfg = compose(tiny=False)
    assert cfg.logger._target_ == "effitrain.train.loggers.WandbLogger" and cfg.logger.mode is None
    tracker = loggers.build_tracker(
        compose("logger=wandb", "logger.mode=disabled"), tmp_path, {"cfg/seed": 42}
    )
    assert isinstance(tracker, loggers.WandbLogger) and tracker.mode == "disabled" and tracker.run is None
    assert loggers.build_tracker(compose("logger=none"), tmp_path, {}) is None


def test_once_a_sweep_job_fell_back_to_offline_the_next_ones_start_offline(tmp_path, monkeypatch, capsys):
    import wandb

    real_init, online_tries = wandb.init, []

    def unreachable(**kwargs):
        if kwargs["mode"] == "online":
            online_tries.append(kwargs["name"])
            raise TimeoutError("no answer from the W&B server")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", unreachable)
    identity = {"group": str(tmp_path), "name": "job", "job_type": "accelerator", "tags": [], "dir": str(tmp_path),
                "multirun": True}  # fmt: skip
    for name in ("first", "second", "third"):
        logger = loggers.WandbLogger({}, dict(identity, name=name), mode="online", init_timeout_s=1)
        assert logger.mode == "offline" and logger.run is not None
        logger.finish({"status": "ok"})
    assert online_tries == ["first"]  # the sweep paid the unreachable server once
    assert (tmp_path / loggers.OFFLINE_MARKER).exists()
    assert capsys.readouterr().out.count("this job starts offline") == 2


def test_a_sweeps_group_is_its_study_and_start_time():
    assert loggers.group_name("/home/me/project/multirun/optimizers/2026-11-24_03-26-51") == (
        "optimizers/2026-11-24_03-26-51"
    )
    assert loggers.group_name("multirun/2026-11-24/03-26-51") == "2026-11-24/03-26-51"  # a plain -m
    assert loggers.group_name(None) is None  # a single run


def test_the_sync_hint_names_the_sweeps_offline_runs_once(tmp_path):
    assert loggers.offline_sync_hint(tmp_path) is None  # nothing offline: no line
    (tmp_path / "wandb" / "offline-run-20261124_032659-0e0ahwrl").mkdir(parents=True)
    assert loggers.offline_sync_hint(tmp_path) == (
        f"effitrain: W&B runs saved offline; upload them with: wandb sync {tmp_path}/wandb/offline-run-*"
    )
