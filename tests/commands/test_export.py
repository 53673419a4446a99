"""``effitrain export``: a finished run becomes a folder plain transformers loads, whose loss on the
run's own eval batches is the run's ``eval/loss``; bad input is one line, exit 2, and nothing written."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from effitrain.cli import main
from tests.helpers.run import REPO, TINY, compose, final_weights, train_py

PLAIN_LOAD = REPO / "tests" / "helpers" / "plain_load.py"
TEXT = "the exported tokenizer splits words as the run's did"
CLASSIFIER = ["max_steps=3", "checkpoint_every=3"]
# lr 1e-2 for 8 steps moves the loss ~0.1 below the untrained ln(vocab): an export that dropped
# the adapter (or scaled it wrongly) is far outside the tolerance below
LORA = ["task=causal_lm", "model=llama_tiny", "adapter=lora", "optimizer.lr=1e-2", "max_length=64",
        "max_steps=8", "checkpoint_every=8"]  # fmt: skip


def trained(folder: Path, *overrides: str) -> dict:
    """A run as a user starts it (``train.py``, so Hydra writes ``.hydra/overrides.yaml``); its summary."""
    done = train_py(*TINY, *overrides, f"hydra.run.dir={folder}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / "summary.json").read_text())


def export(*args: str, capsys) -> tuple[int, str, str]:
    """``effitrain export ARGS`` in this process: (exit code, stdout, stderr)."""
    try:
        main(["export", *args])
        code = 0
    except SystemExit as exited:
        code = exited.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def eval_batches(path: Path, *overrides: str, tiny: bool = True) -> list[int]:
    """The run's eval batches, made by its task's tokenizer and collator, saved for the plain loader;
    the run's tokenizer's ids of TEXT."""
    import torch
    from omegaconf import OmegaConf

    from effitrain.train.data import build_dataloaders, tokenize_cached
    from effitrain.train.modeling import build_tokenizer
    from effitrain.train.tasks import build_task

    cfg = compose(*overrides, tiny=tiny)
    task = build_task(cfg)
    raw, tokenizer = task.load(cfg.data), build_tokenizer(cfg.model)
    source = OmegaConf.to_container(cfg.data, resolve=True)
    tokenized = tokenize_cached(raw, tokenizer, cfg.max_length, cfg.get("cache_dir"), source, task)
    _, loader, _ = build_dataloaders(
        tokenized, task.collator(tokenizer), cfg.micro_batch_size, cfg.eval_batch_size, cfg.seed
    )
    torch.save([dict(batch) for batch in loader], path)
    return tokenizer(TEXT)["input_ids"]


def plain_load(out: Path, auto_class: str, batches: Path) -> dict:
    """The exported folder loaded by a Python that imports transformers and torch, not effitrain."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(PLAIN_LOAD), str(out), auto_class, str(batches), TEXT],
                          capture_output=True, text=True, env=env, cwd=out, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_an_exported_classifier_is_the_runs_final_weights_and_matches_its_eval_loss(
    tmp_path, parallel, capsys
):
    run = tmp_path / "run"
    summary = trained(run, *CLASSIFIER, f"parallel={parallel}")
    code, said, err = export(str(run), capsys=capsys)
    assert code == 0, err
    out = run / "export"
    assert f"-> {out}: AutoModelForSequenceClassification.from_pretrained" in said
    from safetensors.torch import load_file

    # the checkpoint's weights as torch itself reads them (DCP's own joiner for the shards)
    saved, exported = final_weights(run), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(saved)
    assert all(exported[name].equal(saved[name]) for name in saved)
    ids = eval_batches(tmp_path / "batches.pt", *CLASSIFIER, f"parallel={parallel}")
    loaded = plain_load(out, "AutoModelForSequenceClassification", tmp_path / "batches.pt")
    assert loaded["effitrain_modules"] == [] and loaded["ids"] == ids
    # the same float32 weights, batches and kernels: only the order the per-sample losses are summed in
    # differs (the run: one mean of all; here batch means weighed back), a few float32 roundings
    assert loaded["loss"] == pytest.approx(summary["eval/loss"], rel=1e-6)
    if parallel == "fsdp":
        return
    # the command line it is rebuilt from is the run folder's, anyone's to edit: read as data and
    # checked, never run (a YAML object, a model's own code), never other than the checkpoint's config
    overrides = run / ".hydra" / "overrides.yaml"
    written = overrides.read_text()
    marker = tmp_path / "ran"
    edits = {
        f"!!python/object/apply:os.system ['touch {marker}']\n": "no readable .hydra/overrides.yaml (the run's "
        "command line, which Hydra writes): export rebuilds the model from it",
        written + "- seed=7\n": "its config cannot be rebuilt as it ran: seed composes to 7 now, the "
        "checkpoint has 42 (conf/ changed since the run)",
        written + "- model.trust_remote_code=true\n": "its command line does not make a config export can "
        "rebuild (model.trust_remote_code=true is invalid: export runs no code that comes with a model: "
        "export a run of a model transformers builds itself)",
    }
    for text, why in edits.items():
        overrides.write_text(text)
        code, _, err = export(str(run), "--out", str(tmp_path / "edited"), capsys=capsys)
        assert (code, err) == (2, f"effitrain: error: run={str(run)!r} is invalid: {why}\n")
    assert not marker.exists() and not (tmp_path / "edited").exists()
    overrides.write_text(written)
    # never over a folder, even one it wrote; a damaged final checkpoint is named, not exported
    code, _, err = export(str(run), capsys=capsys)
    assert code == 2 and err == (f"effitrain: error: --out={str(out)!r} is invalid: it exists and is not empty: "
                                 "export never overwrites; give a new folder\n")  # fmt: skip
    [checkpoint] = run.glob("checkpoints/step-*")
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    code, _, err = export(str(run), "--out", str(tmp_path / "damaged"), capsys=capsys)
    assert code == 2 and err == (f"effitrain: error: run={str(run)!r} is invalid: its last checkpoint "
                                 f"{checkpoint.name} is model.safetensors differs from its checksum (damaged)\n")  # fmt: skip
    assert not (tmp_path / "damaged").exists()


@pytest.mark.slow
def test_a_failed_write_leaves_no_folder(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    trained(run, *CLASSIFIER)
    from transformers import PreTrainedTokenizerBase

    def full_disk(self, folder, *args, **kwargs):  # after the model's files are written
        assert (Path(folder) / "model.safetensors").exists()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full_disk)
    out = tmp_path / "models" / "classifier"
    code, _, err = export(str(run), "--out", str(out), capsys=capsys)
    assert code == 2 and err == (
        f"effitrain: error: --out={str(out)!r} is invalid: cannot be written (No space left on device)\n"
    )
    assert list(out.parent.iterdir()) == []  # neither the folder nor its partial copy


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_an_exported_lora_llama_is_merged_and_matches_the_runs_eval_loss(tmp_path, adapter, capsys):
    run = tmp_path / "run"
    summary = trained(run, *LORA, f"adapter={adapter}")
    out = tmp_path / "model"
    code, said, err = export(str(run), "--out", str(out), capsys=capsys)
    assert code == 0, err
    assert "adapter merged" in said
    from safetensors.torch import load_file

    names = set(load_file(out / "model.safetensors"))
    assert not (out / "adapter_config.json").exists() and not any("lora" in n for n in names)
    assert "model.layers.0.self_attn.q_proj.weight" in names  # the base's names: a plain Llama
    assert "quantization_config" not in json.loads(
        (out / "config.json").read_text()
    )  # no bitsandbytes needed
    ids = eval_batches(tmp_path / "batches.pt", *LORA, f"adapter={adapter}")
    loaded = plain_load(out, "AutoModelForCausalLM", tmp_path / "batches.pt")
    assert loaded["effitrain_modules"] == [] and loaded["ids"] == ids
    vocabulary = json.loads((out / "config.json").read_text())["vocab_size"]
    assert (
        summary["eval/loss"] < math.log(vocabulary) - 0.05
    )  # the adapter moved it: its loss is not the base's
    # merged, W + (alpha / r) B A is rounded once per weight where the run computed W x + (alpha / r) B (A x)
    # (qlora: W the value of its 4-bit code, as the run's layer dequantized it): measured 7e-8 apart; 1e-5
    # leaves room for other CPUs' kernels and is 1/100 of what the adapter moved
    assert loaded["loss"] == pytest.approx(summary["eval/loss"], rel=1e-5)


def _ok_run(folder: Path, status: str = "ok") -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"status": status, "eval/loss": 1.0}))
    return folder


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    failed = _ok_run(tmp_path / "failed", status="failed")
    ok = _ok_run(tmp_path / "ok")
    victim = tmp_path / "victim"
    victim.mkdir()
    (ok / "export").symlink_to(victim)  # the default output, planted
    (ok / "sub").symlink_to(victim)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    not_ok = "the run ended 'failed', not 'ok': only a finished run is exported"
    link = "is a symbolic link (to {}), and effitrain writes through no link it did not make: remove the link, or give another folder"  # noqa: E501
    cases = [
        ([str(tmp_path / "none")], f"run={str(tmp_path / 'none')!r} is invalid: not a run folder (no readable summary.json): give the folder a run wrote (its hydra.run.dir, or a job's folder of a sweep)"),  # noqa: E501
        ([str(empty)], f"run={str(empty)!r} is invalid: not a run folder (no readable summary.json): give the folder a run wrote (its hydra.run.dir, or a job's folder of a sweep)"),  # noqa: E501
        ([str(failed)], f"run={str(failed)!r} is invalid: {not_ok}"),
        ([str(ok)], f"--out={str(ok / 'export')!r} is invalid: {ok / 'export'} {link.format(victim)}"),
        ([str(ok), "--out", str(ok / "sub" / "m")], f"--out={str(ok / 'sub' / 'm')!r} is invalid: {ok / 'sub'} {link.format(victim)}"),  # noqa: E501
        ([str(ok), "--out", str(full)], f"--out={str(full)!r} is invalid: it exists and is not empty: export never overwrites; give a new folder"),  # noqa: E501
        ([str(ok), "--out", str(tmp_path / "new")], f"run={str(ok)!r} is invalid: it saved no weights (checkpoint_every is off by default): rerun it with checkpoint_every=N, which also saves the last step"),  # noqa: E501
    ]  # fmt: skip
    for args, message in cases:
        code, said, err = export(*args, capsys=capsys)
        assert (code, said, err) == (2, "", f"effitrain: error: {message}\n"), args
    assert list(victim.iterdir()) == [] and (full / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "new").exists() and not (tmp_path / "none").exists()
