"""Checkpoints and resume: SIGKILL mid-training then ``resume=auto`` gives bit-identical parameters;
interrupted writes are never resumed from; a diverged run writes no checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from effitrain.train import resume_point
from tests.helpers.run import REPO, TINY, read_metrics, run_job, train_py

# 64 samples / micro 8 = 8 micro-batches per epoch; 3 epochs = 24 optimizer steps: the kill lands
# mid-run and the resumed run crosses epoch boundaries (new permutation, new loader iterator).
RESUMABLE = ["data.num_train=64", "data.num_eval=16", "epochs=3", "checkpoint_every=3", "checkpoint_keep=2"]
STEPS = 24
KILL_AT_STEP = 4
OPTIMIZERS = ["adamw", "adafactor", "adam8bit"]
BACKENDS = ["accelerator", "trainer"]


def final_weights(run_dir: Path) -> dict:
    _, folder = resume_point.list_checkpoints(run_dir)[-1]
    return load_file(folder / "model.safetensors")


def adapter_weights(run_dir: Path) -> dict:
    _, folder = resume_point.list_checkpoints(run_dir)[-1]
    return load_file(folder / "adapter_model.safetensors")


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """Uninterrupted runs, one per optimizer and backend, made on first use and shared."""
    made = {}

    def get(optimizer: str, backend: str) -> Path:
        if (optimizer, backend) not in made:
            folder = tmp_path_factory.mktemp(f"ref-{optimizer}-{backend}")
            summary = run_job(folder, f"optimizer={optimizer}", f"backend={backend}", *RESUMABLE)
            assert summary["status"] == "ok", summary["error"]
            made[optimizer, backend] = folder
        return made[optimizer, backend]

    return get


def start_and_kill(run_dir: Path, *overrides: str, at_step: int) -> int:
    """Start ``train.py`` and SIGKILL it as soon as metrics.jsonl shows ``at_step``; returns the last step seen."""
    metrics = run_dir / "metrics.jsonl"
    process = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *TINY, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            steps = (
                [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
                if metrics.exists()
                else []
            )
            if steps and steps[-1] >= at_step:
                os.kill(process.pid, signal.SIGKILL)
                break
            time.sleep(0.005)
    finally:
        process.kill()  # no-op when already dead
        process.wait()
    assert process.returncode == -signal.SIGKILL, f"train.py ended by itself (rc {process.returncode})"
    return steps[-1]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sigkill_then_resume_auto_is_bit_identical(tmp_path, reference_runs, optimizer, backend):
    reference = reference_runs(optimizer, backend)
    overrides = [f"optimizer={optimizer}", f"backend={backend}", *RESUMABLE]
    run_dir = tmp_path / "run"
    start_and_kill(run_dir, *overrides, at_step=KILL_AT_STEP)
    assert not (run_dir / "summary.json").exists()
    saved = [step for step, _ in resume_point.list_checkpoints(run_dir)]
    assert saved and saved[-1] >= 3 and len(saved) <= 2

    if (optimizer, backend) == ("adamw", "accelerator"):  # once end to end, as a user types it
        done = train_py(*TINY, *overrides, "resume=auto", f"hydra.run.dir={run_dir}")
        assert done.returncode == 0, done.stderr[-2000:]
    else:  # in this process: saves a second interpreter start per case
        run_job(run_dir, *overrides, "resume=auto")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["train/resumed_from_step"] == saved[-1]
    assert summary["train/steps"] == STEPS and summary["train/samples"] == 3 * 64

    assert_bit_identical(final_weights(run_dir), final_weights(reference))
    # metrics.jsonl: lines past the checkpoint were dropped and written again, identically
    resumed, uninterrupted = read_metrics(run_dir), read_metrics(reference)
    assert [line["step"] for line in resumed] == list(range(1, STEPS + 1))
    assert [line["train/loss"] for line in resumed] == [line["train/loss"] for line in uninterrupted]
    assert [line["train/samples"] for line in resumed] == [line["train/samples"] for line in uninterrupted]


@pytest.mark.slow
@pytest.mark.parametrize(
    "adapter, backend", [("lora", "accelerator"), ("lora", "trainer"), ("qlora", "accelerator")]
)
def test_an_adapter_run_killed_and_resumed_is_bit_identical_and_peft_loads_its_checkpoint(
    tmp_path, adapter, backend
):
    from peft import PeftModel
    from transformers import set_seed

    from tests.train.test_adapters import adapted

    overrides = [f"adapter={adapter}", f"backend={backend}", *RESUMABLE]
    reference = run_job(tmp_path / "reference", *overrides)
    assert reference["status"] == "ok", reference["error"]
    run_dir = tmp_path / "run"
    start_and_kill(run_dir, *overrides, at_step=KILL_AT_STEP)
    resumed = run_job(run_dir, *overrides, "resume=auto")
    assert resumed["status"] == "ok" and resumed["train/resumed_from_step"] >= 3, resumed["error"]
    weights = adapter_weights(run_dir)
    assert_bit_identical(weights, adapter_weights(tmp_path / "reference"))
    assert [m["train/loss"] for m in read_metrics(run_dir)] == [
        m["train/loss"] for m in read_metrics(tmp_path / "reference")
    ]
    assert resumed["eval/loss"] == reference["eval/loss"]  # the rebuilt frozen base is the same too
    # the checkpoint holds peft's own files: the adapter and the head, not the frozen base
    _, folder = resume_point.list_checkpoints(run_dir)[-1]
    names = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "model.safetensors" not in names
    set_seed(42)
    base = adapted()[0]  # a fresh model of the same architecture, no adapter
    loaded = PeftModel.from_pretrained(base, folder)
    trained = {n: p for n, p in loaded.named_parameters() if "lora_" in n or "modules_to_save" in n}
    assert len(trained) == 2 * 13 + 2  # A and B of the 13 targeted Linear layers, the head's 2 tensors
    for name, param in trained.items():  # peft's file names them without the adapter's name
        assert torch.equal(param, weights[name.replace(".modules_to_save", "").replace(".default", "")]), name


@pytest.mark.slow
def test_checkpoint_files_and_pruning(tmp_path):
    summary = run_job(tmp_path, "max_steps=7", "checkpoint_every=3", "checkpoint_keep=2", "compile=on",
                      "compile.backend=aot_eager")  # fmt: skip
    assert summary["status"] == "ok", summary["error"]
    assert [step for step, _ in resume_point.list_checkpoints(tmp_path)] == [6, 7]  # 3 pruned; 7 is the end
    folder = tmp_path / "checkpoints" / "step-00000007"
    assert sorted(p.name for p in folder.iterdir()) == [
        "effitrain.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt"
    ]  # fmt: skip
    meta = resume_point.read_meta(folder)
    assert (meta["step"], meta["epoch"], meta["batches_in_epoch"]) == (7, 0, 7)
    assert meta["meter"]["samples"] == 7 * 8
    weights = load_file(folder / "model.safetensors")
    assert not any(name.startswith("_orig_mod.") for name in weights)
    assert "classifier.weight" in weights
    # everything but the safetensors file loads without unpickling arbitrary objects
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.load(folder / name, weights_only=True)
    assert not list((tmp_path / "checkpoints").glob(".partial-*"))


def test_position_counts_full_windows_and_maps_epoch_end_to_next_epoch():
    # 13 micro-batches, accumulation 4: windows of 4, 4, 4, 1 per epoch
    assert resume_point.position(3, 13, 4) == resume_point.Position(3, 0, 12)
    assert resume_point.position(4, 13, 4) == resume_point.Position(4, 1, 0)
    assert resume_point.position(6, 13, 4) == resume_point.Position(6, 1, 8)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_interrupted_write_leaves_previous_checkpoint_and_auto_uses_it(tmp_path, backend):
    overrides = [
        f"backend={backend}",
        "optimizer=adamw",
        "max_steps=6",
        "checkpoint_every=2",
        "checkpoint_keep=3",
    ]
    reference = tmp_path / "reference"
    assert run_job(reference, *overrides)["status"] == "ok"
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "summary.json").unlink()
    # a kill while step 6 was being written: its files sit half-written in the temporary folder
    step6 = run_dir / "checkpoints" / "step-00000006"
    step6.rename(run_dir / "checkpoints" / ".partial-step-00000006")
    with open(run_dir / "checkpoints" / ".partial-step-00000006" / "optimizer.pt", "r+b") as handle:
        handle.truncate(100)
    # and a finished-looking folder whose file was truncated afterwards (disk full, a copy cut short)
    broken = run_dir / "checkpoints" / "step-00000008"
    shutil.copytree(run_dir / "checkpoints" / "step-00000004", broken)
    with open(broken / "model.safetensors", "r+b") as handle:
        handle.truncate(1000)
    assert resume_point.read_meta(broken) is None
    assert resume_point.newest_valid(run_dir) == run_dir / "checkpoints" / "step-00000004"

    summary = run_job(run_dir, *overrides, "resume=auto")
    assert summary["status"] == "ok", summary["error"]
    assert summary["train/resumed_from_step"] == 4 and summary["train/steps"] == 6
    assert_bit_identical(
        load_file(run_dir / "checkpoints" / "step-00000006" / "model.safetensors"),
        load_file(reference / "checkpoints" / "step-00000006" / "model.safetensors"),
    )
    assert not (run_dir / "checkpoints" / ".partial-step-00000006").exists()


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_another_config(tmp_path):
    assert run_job(tmp_path, "max_steps=2", "checkpoint_every=1")["status"] == "ok"
    # as if killed after its last checkpoint: a finished ok folder is refused before its checkpoints
    # are read (tests/config/test_guards.py, resume=auto with a changed key)
    (tmp_path / "summary.json").unlink()
    summary = run_job(tmp_path, "max_steps=2", "checkpoint_every=1", "optimizer.lr=0.5", "resume=auto")
    assert summary["status"] == "failed" and summary["error_type"] == "config"
    assert summary["error"].startswith("optimizer.lr=0.5 is invalid: differs from the checkpoint")


@pytest.mark.slow
def test_a_checkpoint_of_another_number_of_processes_is_refused_before_anything_is_built(tmp_path):
    from tests.helpers.run import compose

    assert run_job(tmp_path, "max_steps=1", "checkpoint_every=1")["status"] == "ok"
    meta_file = tmp_path / "checkpoints" / "step-00000001" / resume_point.META
    meta = json.loads(meta_file.read_text())
    point = resume_point.find_resume(compose("max_steps=1", "checkpoint_every=1", "resume=auto"), tmp_path)
    assert (point.folder, point.step, point.meta) == (meta_file.parent, 1, meta)
    meta_file.write_text(json.dumps(dict(meta, world_size=2)))
    (tmp_path / "summary.json").unlink()  # as if killed after the checkpoint
    summary = run_job(tmp_path, "max_steps=1", "checkpoint_every=1", "resume=auto")
    assert summary["status"] == "failed" and summary["error_type"] == "config"
    assert summary["error"] == (
        f"resume={str(meta_file.parent)!r} is invalid: written by 2 processes, resumed with 1"
    )
    assert "params/total" not in summary  # refused before the model was built


@pytest.mark.slow
def test_resume_auto_without_checkpoint_starts_from_scratch(tmp_path):
    summary = run_job(tmp_path, "max_steps=2", "resume=auto")
    assert (
        summary["status"] == "ok" and summary["train/resumed_from_step"] == 0 and summary["train/steps"] == 2
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_nan_is_diverged_and_writes_no_checkpoint(tmp_path, backend):
    # lr 1e30 without warmup: step 1 computes a finite loss, then the weights blow up
    overrides = [
        f"backend={backend}",
        "optimizer.lr=1e30",
        "warmup_ratio=0",
        "max_steps=10",
        "checkpoint_every=1",
    ]
    if backend == "accelerator":  # once through the command line, as a user meets it
        done = train_py(*TINY, *overrides, f"hydra.run.dir={tmp_path}")
        assert done.returncode == 1
        assert "effitrain: error: diverged: train/loss is nan at optimizer step 2" in done.stderr
        assert "effitrain: ok" not in done.stdout
        summary = json.loads((tmp_path / "summary.json").read_text())
    else:
        summary = run_job(tmp_path, *overrides)
    assert summary["status"] == "diverged"
    assert summary["error"] == "train/loss is nan at optimizer step 2"
    assert [step for step, _ in resume_point.list_checkpoints(tmp_path)] == [1]
    assert [line["step"] for line in read_metrics(tmp_path)] == [1]


@pytest.mark.slow
@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.pt"])
def test_a_damaged_checkpoint_of_the_right_size_is_skipped_for_the_one_before(tmp_path, damaged, capsys):
    """A byte flipped inside the newest checkpoint: resume=auto names it, falls back to the one
    before and ends with the weights of an uninterrupted run."""
    steps = ["max_steps=4", "checkpoint_every=1", "checkpoint_keep=3"]
    run_dir = tmp_path / "run"
    assert run_job(run_dir, *steps)["status"] == "ok"
    # as if killed after step 3: no final checkpoint, no summary
    shutil.rmtree(run_dir / "checkpoints" / "step-00000004")
    (run_dir / "summary.json").unlink()
    newest = run_dir / "checkpoints" / "step-00000003"
    data = bytearray((newest / damaged).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    (newest / damaged).write_bytes(bytes(data))
    assert resume_point.damage(newest) == f"{damaged} differs from its checksum (damaged)"

    summary = run_job(run_dir, *steps, "resume=auto")
    assert summary["status"] == "ok", summary["error"]
    assert summary["train/resumed_from_step"] == 2 and summary["train/steps"] == 4
    assert f"skipping checkpoint {newest}: {damaged} differs from its checksum" in capsys.readouterr().err
    uninterrupted = tmp_path / "uninterrupted"
    assert run_job(uninterrupted, "max_steps=4", "checkpoint_every=4")["status"] == "ok"
    final = load_file(run_dir / "checkpoints" / "step-00000004" / "model.safetensors")
    expected = load_file(uninterrupted / "checkpoints" / "step-00000004" / "model.safetensors")
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name


@pytest.mark.slow
def test_resume_from_a_damaged_checkpoint_path_is_one_line(tmp_path):
    assert run_job(tmp_path / "run", "max_steps=1", "checkpoint_every=1")["status"] == "ok"
    folder = tmp_path / "run" / "checkpoints" / "step-00000001"
    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(weights))
    summary = run_job(tmp_path / "other", "max_steps=1", f"resume={folder}")
    assert summary["status"] == "failed" and summary["error_type"] == "config"
    assert summary["error"] == (
        f"resume={str(folder)!r} is invalid: the checkpoint is model.safetensors differs from its checksum (damaged)"
    )


@pytest.mark.parametrize("backend", ["accelerator", pytest.param("trainer", marks=pytest.mark.slow)])
def test_a_resumed_run_s_summary_totals_equal_the_uninterrupted_run_s(tmp_path, backend):
    # 24 samples / micro 8 = 3 steps per epoch, 6 in all: the resume from step 2 lands mid-epoch
    # and crosses the epoch's end
    common = [f"backend={backend}", "data.num_train=24", "data.num_eval=8", "epochs=2",
              "checkpoint_every=2", "checkpoint_keep=10"]  # fmt: skip
    whole = run_job(tmp_path / "whole", *common)
    assert whole["status"] == "ok", whole["error"]
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    for step, folder in resume_point.list_checkpoints(tmp_path / "resumed"):
        if step > 2:
            shutil.rmtree(folder)
    (tmp_path / "resumed" / "summary.json").unlink()
    resumed = run_job(tmp_path / "resumed", *common, "resume=auto")
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["train/resumed_from_step"] == 2
    # the mean over all 6 optimizer steps, not over the 4 this process ran, nor of them alone
    losses = [line["train/loss"] for line in read_metrics(tmp_path / "whole")]
    assert len(losses) == 6
    assert whole["train/loss_mean"] == pytest.approx(sum(losses) / 6, rel=1e-12)
    for key in ("train/loss_mean", "train/loss", "train/steps", "train/samples", "train/tokens", "eval/loss"):
        assert resumed[key] == pytest.approx(whole[key], rel=1e-9), key
    assert (resumed["train/steps"], resumed["train/samples"]) == (6, 48)


@pytest.mark.slow
def test_checkpoint_files_follow_the_umask(tmp_path):
    import stat

    summary = run_job(tmp_path, "max_steps=1", "checkpoint_every=1")
    assert summary["status"] == "ok", summary["error"]
    umask = os.umask(0)
    os.umask(umask)
    files = [p for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o666 & ~umask for p in files}


@pytest.mark.slow
def test_resume_auto_of_a_finished_run_with_a_derived_micro_batch_keeps_it_from_the_api(tmp_path):
    # run(cfg) called from Python gets cfg underived (micro_batch_size from the config's default):
    # the finished run's checkpoint is compared with what the run would train, not with that default
    args = [o for o in TINY if not o.startswith("micro_batch_size=")]  # derived, not given
    args += ["max_steps=2", "checkpoint_every=1", "effective_batch_size=4", "gradient_accumulation_steps=2"]
    first = run_job(tmp_path, *args, tiny=False)
    assert first["status"] == "ok" and first["cfg/micro_batch_size"] == 2
    summary_before = (tmp_path / "summary.json").read_bytes()
    again = run_job(tmp_path, *args, "resume=auto", tiny=False)
    assert again == first
    assert (tmp_path / "summary.json").read_bytes() == summary_before


def test_a_resumed_run_remembers_its_best_evaluation_before_the_resume(tmp_path):
    """The best evaluation (eval/best_loss, eval/best_step) is the minimum over every evaluation of
    the run, those before the checkpoint it resumed from included."""
    common = ["data.num_train=40", "data.num_eval=8", "epochs=2", "checkpoint_every=3", "checkpoint_keep=10",
              "eval_every=2", "optimizer.lr=0.05", "lr_scheduler=constant", "warmup_ratio=0"]  # fmt: skip
    whole = run_job(tmp_path / "whole", *common)
    assert whole["status"] == "ok", whole["error"]
    evaluations = read_metrics(tmp_path / "whole", kind="eval")
    best = min(evaluations, key=lambda line: line["eval/loss"])
    assert (whole["eval/best_loss"], whole["eval/best_step"]) == (best["eval/loss"], best["step"])
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    for step, folder in resume_point.list_checkpoints(tmp_path / "resumed"):
        if step > 9:
            shutil.rmtree(folder)
    (tmp_path / "resumed" / "summary.json").unlink()
    resumed = run_job(tmp_path / "resumed", *common, "resume=auto")
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["train/resumed_from_step"] == 9 and best["step"] < 9  # the best came before the resume
    assert (resumed["eval/best_loss"], resumed["eval/best_step"]) == (best["eval/loss"], best["step"])


def test_a_disk_that_fills_during_a_checkpoint_is_one_line_and_leaves_no_partial_files(tmp_path, monkeypatch):
    """torch.save on a full disk raises a C++ assertion; the run says in one line which checkpoint
    could not be written, removes its partial folder (which would keep the disk full) and leaves
    no empty traceback.txt when that cannot be written either."""
    import errno
    from pathlib import Path

    real_save, real_write_text = torch.save, Path.write_text

    def save(obj, path, *args, **kwargs):
        if Path(path).name == "optimizer.pt":
            Path(path).write_bytes(b"\0" * 100)  # part of it got out before the disk was full
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
        return real_save(obj, path, *args, **kwargs)

    def write_text(self, data, *args, **kwargs):
        if self.name == "traceback.txt":
            self.touch()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(Path, "write_text", write_text)
    summary = run_job(tmp_path, "max_steps=2", "checkpoint_every=1")
    assert summary["status"] == "failed"
    assert summary["error"].startswith(
        f"CheckpointNotWritten: the checkpoint of step 1 could not be written in {tmp_path / 'checkpoints'} "
        "(a write failed; "
    )
    assert summary["error"].endswith(" bytes free): its partial files were removed")
    assert "enforce fail" not in summary["error"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []
    assert not (tmp_path / "traceback.txt").exists()


@pytest.mark.parametrize("backend", ["accelerator", pytest.param("trainer", marks=pytest.mark.slow)])
def test_pruning_removes_only_this_run_s_checkpoints(tmp_path, capsys, backend):
    """A damaged ``step-*`` folder numbered above the run's steps (a foreign one: nothing this run wrote)
    is left alone and named; the run's own newest checkpoint is kept (it was pruned away before)."""
    run_dir = tmp_path / "run"
    foreign = run_dir / "checkpoints" / "step-00000099"
    foreign.mkdir(parents=True)
    (foreign / "effitrain.json").write_text("{}")
    steps = ["max_steps=3", "checkpoint_every=1", "checkpoint_keep=1", f"backend={backend}"]
    summary = run_job(run_dir, *steps, "resume=auto")
    assert summary["status"] == "ok", summary.get("error")
    assert [step for step, _ in resume_point.list_checkpoints(run_dir)] == [3, 99]
    assert resume_point.damage(run_dir / "checkpoints" / "step-00000003") is None
    assert (foreign / "effitrain.json").read_text() == "{}"
    err = capsys.readouterr().err
    assert err.count(f"left alone by pruning: {foreign} is not a complete checkpoint of this run") == 1


@pytest.mark.slow
def test_an_earlier_attempt_s_checkpoints_are_this_run_s_and_pruned(tmp_path):
    """The checkpoints of the attempt a resume continues are of this run: pruned like its own."""
    run_dir = tmp_path / "run"
    assert run_job(run_dir, "max_steps=4", "checkpoint_every=1", "checkpoint_keep=3")["status"] == "ok"
    assert [step for step, _ in resume_point.list_checkpoints(run_dir)] == [2, 3, 4]
    shutil.rmtree(run_dir / "checkpoints" / "step-00000004")  # as if killed after step 3
    (run_dir / "summary.json").unlink()
    summary = run_job(run_dir, "max_steps=4", "checkpoint_every=1", "checkpoint_keep=1", "resume=auto")
    assert summary["status"] == "ok" and summary["train/resumed_from_step"] == 3
    assert [step for step, _ in resume_point.list_checkpoints(run_dir)] == [4]
