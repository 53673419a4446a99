"""What the run says as it builds its job: each start-up stage, and how many steps it will take."""

from __future__ import annotations

from effitrain.run.build import plan_line
from tests.helpers.run import compose


def test_the_plan_line_says_max_steps_is_a_cap_and_whether_it_binds():
    """64 micro-batches an epoch in windows of 4: 16 optimizer steps an epoch."""
    cfg = compose("max_steps=20", "gradient_accumulation_steps=4", "epochs=1")  # micro batch 8
    assert plan_line(cfg, 64, 16) == (
        "training: 16 optimizer steps of 4 x 8 samples (1 epoch of 16 steps; max_steps=20 is a cap, not reached)"
    )
    cfg = compose("max_steps=20", "gradient_accumulation_steps=4", "epochs=2")
    assert plan_line(cfg, 64, 20) == (
        "training: 20 optimizer steps of 4 x 8 samples (max_steps=20 cuts the 2 epochs of 16 steps)"
    )
    cfg = compose("gradient_accumulation_steps=3", "epochs=1")  # 10 batches: windows 3, 3, 3, 1
    assert plan_line(cfg, 10, 4) == "training: 4 optimizer steps of 3 x 8 samples (1 epoch of 4 steps)"
    # two processes, each with its share of the batches: a step takes 2 x 3 x 8 = 48 samples
    assert plan_line(cfg, 5, 2, processes=2) == (
        "training: 2 optimizer steps of 2 processes x 3 x 8 samples (1 epoch of 2 steps)"
    )


def test_a_run_says_each_start_up_stage_as_it_begins(tmp_path, capsys):
    from tests.helpers.run import run_job

    assert run_job(tmp_path, "max_steps=1")["status"] == "ok"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("effitrain: ")]
    assert [line.split(" (")[0].split(" at ")[0].split(":")[1].strip() for line in lines[:4]] == [
        "loading the data",
        "tokenizing",
        "building the model",
        "training",
    ]
