"""``effitrain plan`` and MFU: the plan picks what its own predictions say fits; MFU is the FLOPs of a
step (equal to a hand count) over the step time and the device peak."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from effitrain.commands.estimate import estimate_memory
from effitrain.commands.plan import plan
from effitrain.commands.plan_budget import parse_bytes
from effitrain.commands.plan_check import probe
from effitrain.config.errors import ConfigError
from tests.helpers.run import REPO, compose, run_job

# long enough for activations to set the peak; evaluation's rows few, so training's phases set the run's peak
BASE = ["model=tiny", "data=synthetic", "max_length=256", "eval_batch_size=4"]


def nothing_held(optimizers) -> dict:
    """A fake world's counted rows (``estimate_memory(step=False)``, plan's floor): nothing held
    before a step, so the floor never binds and the known peaks alone decide."""
    return {name: {"weights_bytes": 0, "grads_bytes": 0, "optimizer_state_bytes": 0} for name in optimizers}


def predicted(micro: int, effective: int = 16, checkpointing: bool = False, base=BASE) -> int:
    cfg = compose(*base, "optimizer=adafactor", f"gradient_accumulation_steps={effective // micro}",
                  f"gradient_checkpointing={checkpointing}", tiny=False)  # fmt: skip
    cfg.micro_batch_size = micro
    [row] = estimate_memory(cfg, {"adafactor": cfg.optimizer}).values()
    return row["run_peak_bytes"]


@pytest.mark.slow
def test_a_budget_between_two_peaks_picks_the_larger_micro_batch_that_fits():
    whole, half = predicted(16), predicted(8)
    assert whole > half  # activations grow with the micro batch
    rows = plan(BASE, (whole + half) // 2, effective=16, optimizers=["adafactor"], precisions=["fp32"],
                checkpointing=[False], margin=0.0)  # fmt: skip
    best = rows[0]
    assert (best["micro_batch_size"], best["gradient_accumulation_steps"], best["fits"]) == (8, 2, True)
    assert best["run_peak_bytes_predicted"] == half
    # 16 is over: the smallest (1) is traced next, to know that some micro batch fits; then 8 fits
    assert [(r["micro_batch_size"], r["fits"]) for r in rows] == [(8, True), (1, True), (16, False)]
    assert best["command"].endswith(
        "optimizer=adafactor precision=fp32 effective_batch_size=16 gradient_accumulation_steps=2"
    )


@pytest.mark.slow
def test_gradient_checkpointing_is_planned_where_it_saves_accumulation_steps():
    base = [*BASE, "model.architecture.num_hidden_layers=4"]  # recomputation pays with more layers
    plain, checkpointed = predicted(16, base=base), predicted(16, checkpointing=True, base=base)
    half = predicted(8, base=base)
    assert checkpointed < half < plain  # recomputation keeps one layer's activations, not all of them
    # checkpointing of every block only (the lever axis's every second block: tests further down)
    rows = plan(base, (half + checkpointed) // 2, effective=16, optimizers=["adafactor"], precisions=["fp32"],
                margin=0.0, checkpointing=[False, True])  # fmt: skip
    best = rows[0]
    assert (best["micro_batch_size"], best["gradient_checkpointing"], best["fits"]) == (16, True, True)
    assert best["run_peak_bytes_predicted"] == checkpointed
    assert best["command"].endswith("gradient_accumulation_steps=1 gradient_checkpointing=true")
    # without checkpointing micro batch 4 fits (1 too: traced when 16 did not fit, to know that one
    # does); with it, micro batches under 16 are not tried
    assert [(r["micro_batch_size"], r["gradient_checkpointing"], r["fits"]) for r in rows[1:]] == [
        (4, False, True), (1, False, True), (16, False, False), (8, False, False)
    ]  # fmt: skip
    # the real checkpointed step stays under the plan's worst case (shorter texts: less)
    [probed] = [r for r in probe(rows, base, steps=4) if r["gradient_checkpointing"]]
    assert 0 < probed["step_peak_bytes_measured"] <= probed["step_peak_bytes_predicted"]
    assert probed["step_s_measured"] > 0


@pytest.mark.slow
def test_probe_steps_rank_by_measured_step_time_and_measure_the_predicted_peak():
    # every text longer than max_length: each micro-batch is the worst case the plan predicts
    base = ["model=tiny", "data=synthetic", "max_length=64", "data.words_per_text=100"]
    rows = plan(base, 2**40, effective=8, optimizers=["adafactor", "adamw"], precisions=["fp32"],
                checkpointing=[False])  # fmt: skip
    # a tie: the config's own optimizer first
    assert [(r["optimizer"], r["micro_batch_size"], r["fits"]) for r in rows] == [
        ("adamw", 8, True), ("adafactor", 8, True)
    ]  # fmt: skip
    probed = probe(rows, base, steps=4)
    times = [r["step_s_measured"] for r in probed]
    assert all(t > 0 for t in times) and times == sorted(times)
    for row in probed:  # the plan's worst case bounds the real step, which is that case here
        assert 0.99 * row["step_peak_bytes_predicted"] <= row["step_peak_bytes_measured"], row["optimizer"]
        assert row["step_peak_bytes_measured"] <= row["step_peak_bytes_predicted"], row["optimizer"]


@pytest.mark.slow
def test_a_budget_nothing_fits_is_one_line_naming_the_smallest_peak():
    done = subprocess.run(
        # above Adafactor's 7.8 MiB of weights, gradients and state (less the margin: plan's floor),
        # below every candidate's peak (15.4 MiB and more)
        [sys.executable, "-m", "effitrain.cli", "plan", "--memory-budget", "12MiB", "--effective-batch-size", "2",
         "--optimizers", "adafactor", *BASE],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 2
    # the progress bar (candidates traced, cached, skipped), then the one error line
    *progress, line = done.stderr.strip().splitlines()
    bar = [p for p in progress if p.startswith("effitrain plan: ")]  # libraries may warn before it
    # fp32 and bf16, no lever and checkpointing of every second block and of every block (the tiny
    # classifier on the CPU profile takes no other lever), micro batches 2 and 1: all 12 over, none skipped
    counts = re.search(r"traced=(\d+), derived=(\d+), cached=(\d+), skipped=0]$", bar[-1]).groups()
    assert "| 12/12 [" in bar[-1] and sum(map(int, counts)) == 12
    assert line.startswith(
        "effitrain: error: --memory-budget='12MiB': nothing fits; the smallest predicted run peak is"
    )


@pytest.mark.slow
def test_a_budget_nothing_fits_traces_the_largest_and_the_smallest_micro_batch_only(capsys):
    # 16 MiB: above both optimizers' weights, gradients and state (Lion's 11.6 MiB: plan's floor),
    # below their peaks
    rows = plan(BASE, 16 * 2**20, effective=16, optimizers=["adafactor", "lion"], precisions=["fp32"],
                checkpointing=[False])  # fmt: skip
    # memory grows with the micro batch: with 1 and 16 over budget, 8, 4 and 2 cannot fit either
    assert [(r["optimizer"], r["micro_batch_size"], r["fits"]) for r in rows] == [
        ("adafactor", 16, False),
        ("lion", 16, False),
        ("adafactor", 1, False),
        ("lion", 1, False),
    ]  # fmt: skip (ranked: fewer accumulation steps first, then the order given)
    # both optimizers' candidates from one replay each micro batch, their steps replayed at 16 and
    # reused at 1 (the same gradients); 8, 4 and 2 of each skipped
    assert [r["trace_source"] for r in rows] == ["shared"] * 2 + ["shared, step reused"] * 2
    progress = capsys.readouterr().err.strip().splitlines()[-1]
    assert "| 10/10 [" in progress and progress.endswith("traced=2, derived=2, cached=0, skipped=6]")


@pytest.mark.parametrize(
    "margin, expected, traced",
    [  # peak = 1000 + 100 x micro (a quarter of that with checkpointing); budget 1500
        (0.0, [(8, True, True), (4, False, True), (1, False, True), (8, False, False)],
         ["micro 8 x 1", "micro 1 x 8", "micro 4 x 2", "micro 8 x 1 recompute"]),
        # 10% kept free: 1350 is the limit, so 4 (1400) is over and 2 (1200) the best plain fit
        (0.1, [(8, True, True), (2, False, True), (1, False, True), (8, False, False), (4, False, False)],
         ["micro 8 x 1", "micro 1 x 8", "micro 4 x 2", "micro 2 x 4", "micro 8 x 1 recompute"]),
    ],
)  # fmt: skip
def test_the_search_traces_and_ranks_candidates_by_their_predicted_peaks(monkeypatch, capsys, margin, expected,
                                                                         traced):  # fmt: skip
    """plan's search against peaks known in advance (the slow tests above run the real traces):
    from the largest micro batch down, the smallest traced when the largest is over, checkpointing
    tried only where it saves accumulation steps, fits ranked by fewer steps first."""
    import effitrain.commands.estimate

    asked = []

    def known_peaks(cfg, optimizers, device, cache, share, steps=None, world_size=1, step=True):
        if not step:
            return nothing_held(optimizers)
        assert (
            list(optimizers) == ["adamw"]
            and device == "cpu"
            and cfg.effective_batch_size == 8
            and world_size == 1
        )
        asked.append((cfg.micro_batch_size, cfg.gradient_checkpointing, share))
        assert cfg.micro_batch_size * cfg.gradient_accumulation_steps == 8  # derived as a run does
        peak = 1000 + 100 * cfg.micro_batch_size // (4 if cfg.gradient_checkpointing else 1)
        return {"adamw": {"step_peak_bytes": peak, "run_peak_bytes": peak, "run_peak": "later_step"}}

    monkeypatch.setattr(effitrain.commands.estimate, "estimate_memory", known_peaks)
    rows = plan(BASE, 1500, effective=8, optimizers=["adamw"], precisions=["fp32"], margin=margin,
                checkpointing=[False, True])  # fmt: skip
    assert [(r["micro_batch_size"], r["gradient_checkpointing"], r["fits"]) for r in rows] == expected
    peaks = [1000 + 100 * r["micro_batch_size"] // (4 if r["gradient_checkpointing"] else 1) for r in rows]
    assert [r["run_peak_bytes_predicted"] for r in rows] == peaks
    assert rows[0]["command"].endswith(
        "fp32 effective_batch_size=8 gradient_accumulation_steps=1 gradient_checkpointing=true"
    )
    # the search, then the best replayed in full, unshared
    best = (rows[0]["micro_batch_size"], rows[0]["gradient_checkpointing"], False)
    assert [f"micro {m} x {8 // m}{' recompute' if c else ''}" for m, c, _ in asked[:-1]] == traced
    assert asked[-1] == best
    assert [share for *_, share in asked] == [True] * len(traced) + [False]
    assert rows[0]["confirmed_by_full_replay"]


@pytest.mark.parametrize("budget", ["0", "1MiB"])
def test_a_budget_below_the_weights_is_refused_at_once_without_tracing(capsys, budget):
    from effitrain.cli import main
    from effitrain.train.modeling import build_model, build_tokenizer

    cfg = compose(*BASE, tiny=False)
    model = build_model(cfg.model, cfg.data.num_labels, build_tokenizer(cfg.model))  # real weights, counted
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--memory-budget", budget, *BASE])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (  # no progress line: nothing was traced
        f"effitrain: error: --memory-budget={budget!r} is invalid: the model's weights alone take "
        f"{weights / 2**20:.1f} MiB (with the 10% margin, --margin): give more than {weights / 0.9 / 2**20:.1f}MiB\n"
    )


def test_too_few_probe_steps_are_refused_before_any_trace(capsys):
    from effitrain.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["plan", "--memory-budget", "1GiB", "--probe-steps", "2", *BASE])
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("effitrain: error: --probe-steps=2 is invalid: give 0 (no probe) or at least 4")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--margin", "-0.5"], "--margin=-0.5 is invalid: give the share of the budget kept free, in [0, 1)"),
        (["--margin", "1"], "--margin=1.0 is invalid: give the share of the budget kept free, in [0, 1)"),
        (
            ["--optimizers", "adamw,nonsense"],
            "--optimizers='nonsense' is invalid: choose from adafactor, adam8bit",
        ),
        (
            ["--adapters", "lora,nonsense"],
            "--adapters='nonsense' is invalid: choose from dora, lora, lora_r32, none, qlora",
        ),
    ],
)
def test_plan_s_bad_flags_are_one_line_before_any_trace(capsys, flags, message):
    # a negative margin would call candidates above the budget "fits"
    from effitrain.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["plan", "--memory-budget", "1GiB", *flags, *BASE])
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"effitrain: error: {message}")


def test_plan_names_an_optimizer_whose_package_is_missing_in_one_line(capsys, monkeypatch):
    import importlib.util

    from effitrain.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lion_pytorch" else real(name, *a)
    )
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--memory-budget", "1GiB", "--optimizers", "adamw,lion", *BASE])
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("effitrain: error: --optimizers='lion' is invalid: lion_pytorch is not installed")


def test_budget_sizes_parse_and_bad_ones_are_refused():
    assert [parse_bytes(t) for t in ("8GiB", "500MiB", "24GB", "1024")] == [
        8 * 2**30,
        500 * 2**20,
        24 * 10**9,
        1024,
    ]
    with pytest.raises(ConfigError, match="--memory-budget='lots' is invalid"):
        parse_bytes("lots")


def test_flops_per_step_match_a_hand_count_and_mfu_is_their_rate_over_the_peak(tmp_path):
    """The tiny BERT (2 layers, hidden 32, 2 heads, intermediate 64, 3 labels) on rows all truncated to
    8 tokens, 8 rows a step: every matrix product counted here, 2 FLOPs per multiply-add, and the
    backward pass twice the forward (the input's and the weight's gradient of every product)."""
    from effitrain.memory.flops import device_peak

    summary = run_job(tmp_path, "max_steps=4", "max_length=8", "micro_batch_size=8")
    assert summary["status"] == "ok", summary["error"]
    assert summary["train/tokens"] == 4 * 8 * 8  # every row really is 8 tokens long
    rows, seq, hidden, heads, inner, layers, labels = 8, 8, 32, 2, 64, 2, 3
    tokens = rows * seq
    per_layer = (
        4 * 2 * tokens * hidden * hidden  # query, key, value, output projections
        + 2 * 2 * tokens * hidden * inner  # feed-forward in and out
        + 2 * 2 * rows * heads * seq * seq * (hidden // heads)  # scores and the weighted sum
    )
    forward = layers * per_layer + 2 * rows * hidden * hidden + 2 * rows * hidden * labels  # pooler, head
    assert summary["speed/flops_per_step"] == 3 * forward == 6_738_432
    peak, source = device_peak(torch.device("cpu"), "no")
    assert summary["speed/mfu_note"] == source == "this CPU's float32 matmul, measured"
    achieved = 3 * forward / summary["speed/step_s_median"]
    assert summary["speed/achieved_flops_per_s"] == pytest.approx(achieved, rel=1e-12)
    assert summary["speed/mfu"] == pytest.approx(achieved / peak, rel=1e-12)


@pytest.mark.parametrize("checkpointing, layers_recomputed", [("false", 0), ("2", 1), ("true", 2)])
def test_the_recomputed_flops_are_the_checkpointed_layers_forward_by_hand(checkpointing, layers_recomputed):
    """plan's cost of checkpointing, from the replay: the tiny BERT's layers (as in the hand count
    above: 8 rows of 8 tokens) each recomputed once in backward, their forward FLOPs and nothing
    more; every second block (the first of 2) half of every block."""
    cfg = compose("max_length=8", "micro_batch_size=8", f"gradient_checkpointing={checkpointing}")
    [row] = estimate_memory(cfg).values()
    rows, seq, hidden, heads, inner = 8, 8, 32, 2, 64
    tokens = rows * seq
    per_layer = (
        4 * 2 * tokens * hidden * hidden
        + 2 * 2 * tokens * hidden * inner
        + 2 * 2 * rows * heads * seq * seq * (hidden // heads)
    )
    assert row["recomputed_flops_per_step"] == layers_recomputed * per_layer
    assert row["flops_per_step"] == 6_738_432  # model FLOPs: recomputation left out


def test_on_cuda_half_precision_ranks_before_fp32_at_equal_steps(monkeypatch):
    """The CUDA profile: with the same accumulation and no recomputation, bf16 (tensor cores) before
    fp32; on CPU fp32 first. Peaks known in advance, every candidate fits."""
    import effitrain.commands.estimate

    devices = []

    def known_peaks(cfg, optimizers, device, **how):
        if not how.get("step", True):
            return nothing_held(optimizers)
        devices.append(device)
        return {name: {"step_peak_bytes": 100, "run_peak_bytes": 100, "run_peak": {}} for name in optimizers}

    monkeypatch.setattr(effitrain.commands.estimate, "estimate_memory", known_peaks)
    for device, order in (("cuda", ["bf16", "fp32"]), ("cpu", ["fp32", "bf16"])):
        rows = plan(BASE, 10**9, effective=4, optimizers=["adamw"], precisions=["fp32", "bf16"],
                    checkpointing=[False], device=device)  # fmt: skip
        # the largest micro batch fits for each precision: one row each
        assert [(r["precision"], r["micro_batch_size"], r["fits"]) for r in rows] == [
            (p, 4, True) for p in order
        ]
        assert set(devices) == {device}
        devices.clear()


def test_an_optimizer_whose_weights_gradients_and_state_alone_exceed_the_budget_is_not_traced(
    monkeypatch, capsys
):
    """Every update holds the weights, all gradients and the optimizer state at once: where their
    counted bytes alone exceed the usable budget (here AdamW's 400 + 400 + 1,200 of 1,500), no micro
    batch can fit, and the candidate is said and never replayed; Adafactor's (400 + 400 + 10) is
    replayed. With the update in backward no gradient is held whole: its floor leaves them out."""
    import effitrain.commands.estimate

    counted = {"adamw": (400, 400, 1200), "adafactor": (400, 400, 10)}
    traced = []

    def known_peaks(cfg, optimizers, device, cache, share, steps=None, world_size=1, step=True):
        if not step:
            keys = ("weights_bytes", "grads_bytes", "optimizer_state_bytes")
            return {name: dict(zip(keys, counted[name])) for name in optimizers}
        traced.extend((name, bool(cfg.optimizer_in_backward)) for name in optimizers)
        return {
            name: {"step_peak_bytes": 1200, "run_peak_bytes": 1200, "run_peak": {}} for name in optimizers
        }

    monkeypatch.setattr(effitrain.commands.estimate, "estimate_memory", known_peaks)
    rows = plan([*BASE, "max_grad_norm=0"], 1500, effective=1, optimizers=["adamw", "adafactor"],
                precisions=["fp32"], checkpointing=[False], margin=0.0)  # fmt: skip
    assert {name for name, _ in traced} == {"adafactor"} and {r["optimizer"] for r in rows} == {"adafactor"}
    said = capsys.readouterr()
    assert (
        "optimizer=adamw precision=fp32 cannot fit: its weights, gradients and optimizer state alone are 0.0 MiB"
        in (said.out + said.err)
    )
    counted["adamw"] = (400, 400, 650)  # 1,450 with its gradients, 1,050 without: only in backward
    traced.clear()
    plan([*BASE, "max_grad_norm=0"], 1500, effective=1, optimizers=["adamw"], precisions=["fp32"],
         checkpointing=[False], margin=0.0)  # fmt: skip
    assert ("adamw", False) in traced  # 1,450 <= 1,500: traced as it is
    counted["adamw"] = (400, 400, 800)
    traced.clear()
    plan([*BASE, "max_grad_norm=0"], 1500, effective=1, optimizers=["adamw"], precisions=["fp32"],
         checkpointing=[False], margin=0.0)  # fmt: skip
    assert set(traced) == {("adamw", True)}  # only with the update in backward: 1,200 without the gradients
    counted["adamw"] = (400, 400, 1200)  # the whole model's 2,000; FSDP over 2 GPUs: a rank holds 1,000
    traced.clear()
    plan([*BASE, "max_grad_norm=0"], 1500, effective=2, optimizers=["adamw"], precisions=["fp32"],
         checkpointing=[False], margin=0.0, gpus=2)  # fmt: skip
    assert ("adamw", False) in traced


def test_a_budget_every_optimizer_s_floor_exceeds_is_one_line_naming_the_smallest(monkeypatch):
    """Every optimizer over the floor (its counted weights, gradients and state alone above the usable
    budget, even with the update in backward): nothing is traced, and one line names the smallest."""
    import effitrain.commands.estimate
    from effitrain.config.errors import ConfigError

    counted = {"adamw": (400, 400, 1200), "adafactor": (400, 400, 1150)}

    def known_peaks(cfg, optimizers, device, cache, share, steps=None, world_size=1, step=True):
        assert not step, "nothing is traced"
        keys = ("weights_bytes", "grads_bytes", "optimizer_state_bytes")
        return {name: dict(zip(keys, counted[name])) for name in optimizers}

    monkeypatch.setattr(effitrain.commands.estimate, "estimate_memory", known_peaks)
    with pytest.raises(ConfigError) as refused:
        plan([*BASE, "max_grad_norm=0"], 1500, effective=1, optimizers=["adamw", "adafactor"],
             precisions=["fp32"], checkpointing=[False], margin=0.0)  # fmt: skip
    assert str(refused.value) == (
        "--memory-budget=0.0MiB is invalid: nothing fits; the smallest weights, gradients and optimizer "
        "state alone are 0.0 MiB (optimizer=adafactor precision=fp32 optimizer_in_backward=true), "
        "0.0 MiB usable with the 0% margin (--margin)"
    )


def test_among_equal_candidates_the_config_s_own_optimizer_ranks_first(monkeypatch):
    """Peaks known in advance and every candidate fitting at the same micro batch: the rules have
    nothing to tell the optimizers apart, so the config's own comes first, then conf/optimizer's order."""
    import effitrain.commands.estimate

    def known_peaks(cfg, optimizers, device, **how):
        if not how.get("step", True):
            return nothing_held(optimizers)
        return {name: {"step_peak_bytes": 100, "run_peak_bytes": 100, "run_peak": {}} for name in optimizers}

    monkeypatch.setattr(effitrain.commands.estimate, "estimate_memory", known_peaks)
    names = ["adafactor", "adamw", "lion"]
    for own, order in ((None, ["adamw", "adafactor", "lion"]), ("lion", ["lion", "adafactor", "adamw"])):
        overrides = BASE + ([f"optimizer={own}"] if own else [])  # the default config's own: adamw
        rows = plan(
            overrides, 10**9, effective=4, optimizers=names, precisions=["fp32"], checkpointing=[False]
        )
        assert [(r["optimizer"], r["micro_batch_size"], r["fits"]) for r in rows] == [
            (n, 4, True) for n in order
        ]


@pytest.mark.parametrize(
    "device, peak, fits",
    [("cpu", 966_367_641, True), ("cpu", 966_367_642, False),  # 1 GiB x 0.9 = 966,367,641.6
     ("cuda", 966_367_641, False), ("cuda", 899_258_777, True), ("cuda", 899_258_778, False)],
)  # fmt: skip
def test_on_cuda_the_budget_keeps_cublas_workspaces_free(monkeypatch, device, peak, fits):
    """On CUDA, cuBLAS's workspaces (32 MiB for each of the step's and autograd's threads, which no
    replayed tensor holds) come off the budget with the margin: 1 GiB x 0.9 - 64 MiB = 899,258,777.6."""
    import effitrain.commands.estimate

    def known_peak(cfg, optimizers, device, **how):
        if not how.get("step", True):
            return nothing_held(optimizers)
        return {
            name: {"step_peak_bytes": peak, "run_peak_bytes": peak, "run_peak": {}} for name in optimizers
        }

    monkeypatch.setattr(effitrain.commands.estimate, "estimate_memory", known_peak)
    # one candidate: CUDA's activation offloading (a lever plan tries there) held off
    rows = plan([*BASE, "activation_offloading=false"], 2**30, effective=1, optimizers=["adamw"],
                precisions=["fp32"], checkpointing=[False], device=device)  # fmt: skip
    assert [row["fits"] for row in rows] == [fits]


def sharded_peak(gpus: int, micro: int, effective: int = 8) -> int:
    """The run peak of one rank of ``gpus`` with AdamW at this micro batch (fp32), accumulating the
    rest of the effective batch (under FSDP, unsharded gradients accumulate between the syncs)."""
    overrides = [*BASE, "optimizer=adamw", f"gradient_accumulation_steps={effective // (gpus * micro)}"]
    cfg = compose(*overrides, *(["parallel=fsdp"] if gpus > 1 else []), tiny=False)
    cfg.micro_batch_size = micro
    [row] = estimate_memory(cfg, {"adamw": cfg.optimizer}, world_size=gpus).values()
    return row["run_peak_bytes"]


@pytest.mark.slow
def test_gpus_proposes_the_fewest_that_fit_with_fsdp_beside_one_device():
    """Effective batch 8: one device, even at micro 1, is over budget, so is a rank of 2; a rank of 4
    fits: 4 is proposed, and 8 is never traced."""
    one, two, four = sharded_peak(1, 1), sharded_peak(2, 1), sharded_peak(4, 1)
    assert one > two > four  # each rank holds less of the model's state
    from effitrain.commands.plan import plan_over_gpus

    rows = plan_over_gpus(BASE, (two + four) // 2, "budget", [8, 1, 4, 2], effective=8, optimizers=["adamw"],
                          margin=0.0, precisions=["fp32"], checkpointing=[False])  # fmt: skip
    best = rows[0]
    assert (best["gpus"], best["fits"]) == (4, True)
    assert best["gradient_accumulation_steps"] * best["micro_batch_size"] * 4 == 8
    assert best["run_peak_bytes_predicted"] == sharded_peak(4, best["micro_batch_size"])
    assert (
        best["command"].startswith("torchrun --nproc_per_node 4 train.py ")
        and "parallel=fsdp" in best["command"]
    )
    assert {r["gpus"] for r in rows} == {1, 2, 4} and not any(r["fits"] for r in rows if r["gpus"] < 4)
    assert min(r["run_peak_bytes_predicted"] for r in rows if r["gpus"] == 2) == two


def test_gpus_that_do_not_divide_the_effective_batch_are_refused_in_one_line():
    from effitrain.commands.plan import plan_over_gpus

    with pytest.raises(
        ConfigError, match=r"^--gpus=3 is invalid: give a number of GPUs, 1 or more, that divides"
    ):
        plan_over_gpus(BASE, 2**30, "1GiB", [1, 3], effective=4)


@pytest.mark.slow
def test_full_fine_tuning_ranks_first_where_it_fits_and_an_adapter_where_only_it_does():
    """--adapters none,lora: the adapter ranks before speed, in the order given; full fine-tuning
    with accumulation is still the best over LoRA without."""
    from effitrain.config.load import apply_effective_batch_size

    def peak(adapter: str, micro: int) -> int:  # effitrain estimate's run peak
        cfg = compose(*BASE, f"adapter={adapter}", "optimizer=adamw", "effective_batch_size=4",
                      f"gradient_accumulation_steps={4 // micro}", tiny=False)  # fmt: skip
        apply_effective_batch_size(cfg)
        return estimate_memory(cfg)["chosen"]["run_peak_bytes"]

    full = {micro: peak("none", micro) for micro in (4, 2, 1)}
    lora = peak("lora", 4)
    # gradients and AdamW's moments of every weight are full fine-tuning's only
    assert full[4] > full[2] > full[1] > lora

    def best(budget: int) -> dict:
        rows = plan(BASE, budget, effective=4, optimizers=["adamw"], adapters=["none", "lora"],
                    precisions=["fp32"], checkpointing=[False], margin=0.0)  # fmt: skip
        return rows[0]

    for budget, expected in [
        (full[4], ("none", 4, full[4])),
        (full[4] - 1, ("none", 2, full[2])),
        (full[1] - 1, ("lora", 4, lora)),
    ]:
        row = best(budget)
        assert (row["adapter"], row["micro_batch_size"], row["run_peak_bytes_predicted"]) == expected
        assert row["fits"] and f"adapter={expected[0]}" in row["command"].split()


def test_the_best_candidate_is_confirmed_by_a_full_replay_and_a_shared_fault_is_caught(monkeypatch):
    """Every candidate from the shared replay, the best one again from a full trace of its own:
    equal here; a shared replay that found one byte less is refused."""
    base = ["model=tiny", "data=synthetic", "max_length=16", "eval_batch_size=2", "model.architecture.num_hidden_layers=1"]
    rows = plan(
        base, 2**40, effective=2, optimizers=["adamw", "lion"], precisions=["fp32"], checkpointing=[False]
    )
    assert [(r["optimizer"], r["micro_batch_size"], r["trace_source"]) for r in rows] == [
        ("adamw", 2, "shared"), ("lion", 2, "shared")
    ]  # fmt: skip
    assert rows[0]["confirmed_by_full_replay"] and "confirmed_by_full_replay" not in rows[1]
    import effitrain.memory.shared_traces

    shared = effitrain.memory.shared_traces.trace_runs

    def one_byte_less(*args):
        traces = shared(*args)
        for trace in traces.values():
            trace.phases["later_step"]["temporaries"] -= 1
            trace.phases["later_step"]["total"] -= 1
        return traces

    monkeypatch.setattr(effitrain.memory.shared_traces, "trace_runs", one_byte_less)
    with pytest.raises(RuntimeError, match="the full replay of the plan's best"):
        plan(base, 2**40, effective=2, optimizers=["adamw"], precisions=["fp32"], checkpointing=[False])


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_an_optimizer_s_node_reads_no_micro_batch_accumulation_or_checkpointing(adapter):
    """plan composes each optimizer's node once per adapter and precision and hands it to every micro
    batch and checkpointing setting: the node a full composition gives there is the same."""
    from omegaconf import OmegaConf

    from effitrain.config.registry import group_options

    for name in group_options("optimizer"):
        once = compose(f"optimizer={name}", f"adapter={adapter}", "precision=bf16")
        there = compose(f"optimizer={name}", f"adapter={adapter}", "precision=bf16", "effective_batch_size=16",
                        "gradient_accumulation_steps=4", "gradient_checkpointing=true")  # fmt: skip
        assert OmegaConf.to_container(there.optimizer, resolve=True) == OmegaConf.to_container(
            once.optimizer, resolve=True
        ), name
        assert there.gradient_accumulation_steps == 4  # the overrides took


def run_config(cfg) -> dict:
    """Every key of ``cfg`` but Hydra's own node, resolved."""
    import copy

    from omegaconf import OmegaConf, open_dict

    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg, resolve=True)


def test_the_lever_axis_tries_each_lever_where_it_saves_steps_and_ranks_by_its_cost(monkeypatch):
    """Every lever a config can take is an axis of plan, tried only for micro batches larger than
    the best fit without one, and ranked at equal accumulation by its cost: the FLOPs its replay
    recomputes at LEVER_RATES (every second block recomputes half of what every block does)."""
    import effitrain.commands.estimate
    from effitrain.commands.plan_levers import LEVER_RATES

    asked = []

    def known_peaks(cfg, optimizers, device, cache, share, steps=None, world_size=1, step=True):
        if not step:
            return nothing_held(optimizers)
        every = {False: 0, True: 1, 2: 2}[cfg.gradient_checkpointing]
        asked.append((cfg.micro_batch_size, cfg.gradient_checkpointing))
        # activations 100 per sample; every block recomputed keeps a quarter, every second one half
        peak = 1000 + 100 * cfg.micro_batch_size // {0: 1, 1: 4, 2: 2}[every]
        recomputed = {0: 0, 1: 3_000_000, 2: 1_500_000}[every] * cfg.micro_batch_size
        row = {"step_peak_bytes": peak, "run_peak_bytes": peak, "run_peak": "later_step",
               "recomputed_flops_per_step": recomputed}  # fmt: skip
        return {"adamw": row}

    monkeypatch.setattr(effitrain.commands.estimate, "estimate_memory", known_peaks)
    # micro 8 x 1: plain 1800, every second block 1400, every block 1200; budget 1450
    rows = plan(BASE, 1450, effective=8, optimizers=["adamw"], precisions=["fp32"], margin=0.0)
    best = rows[0]
    assert (best["micro_batch_size"], best["gradient_checkpointing"], best["levers"]) == (
        8,
        2,
        {"gradient_checkpointing": 2},
    )
    assert best["command"].endswith("gradient_accumulation_steps=1 gradient_checkpointing=2")
    assert best["recomputed_flops"] == 12_000_000
    assert best["lever_cost_s"] == 12_000_000 / LEVER_RATES["cpu"]["flops_per_s"]
    second = rows[1]  # every block also fits at micro 8, and recomputes twice as much: after it
    assert (second["micro_batch_size"], second["gradient_checkpointing"], second["fits"]) == (8, True, True)
    assert second["lever_cost_s"] == 2 * best["lever_cost_s"]
    assert rows[2]["levers"] == {} and rows[2]["micro_batch_size"] == 4  # 1400: the best plain fit
    # plain: 8 over, 1 fits, 4 fits; each lever only at 8 (fewer steps than 2); the best confirmed
    assert asked == [(8, False), (1, False), (4, False), (8, 2), (8, True), (8, 2)]


def test_every_lever_is_tried_at_its_largest_micro_batch_before_any_smaller_one(monkeypatch):
    """A lever that fits at the largest micro batch bounds every other lever's search: none is traced
    at more accumulation steps (it would rank below). Every second block recomputed does not fit at
    micro 8 but would at 4; every block fits at 8, so micro 4 is never traced for either."""
    import effitrain.commands.estimate

    asked = []

    def known_peaks(cfg, optimizers, device, cache, share, steps=None, world_size=1, step=True):
        if not step:
            return nothing_held(optimizers)
        asked.append((cfg.micro_batch_size, cfg.gradient_checkpointing))
        peak = 1000 + 100 * cfg.micro_batch_size // {False: 1, 2: 2, True: 4}[cfg.gradient_checkpointing]
        return {"adamw": {"step_peak_bytes": peak, "run_peak_bytes": peak, "run_peak": "later_step"}}

    monkeypatch.setattr(effitrain.commands.estimate, "estimate_memory", known_peaks)
    # plain: 8 -> 1800, 1 -> 1100, 4 -> 1400, 2 -> 1200; every second block: 8 -> 1400, 4 -> 1200;
    # every block: 8 -> 1200; budget 1250
    rows = plan(BASE, 1250, effective=8, optimizers=["adamw"], precisions=["fp32"], margin=0.0)
    assert [(r["micro_batch_size"], r["gradient_checkpointing"], r["fits"]) for r in rows] == [
        (8, True, True), (2, False, True), (1, False, True), (8, False, False), (8, 2, False), (4, False, False),
    ]  # fmt: skip
    # plain from 8 down; each lever at 8; every second block's micro 4 (2 steps) ranks below a fit
    # at 1 step: not traced; the best replayed in full
    assert asked == [(8, False), (1, False), (4, False), (2, False), (8, 2), (8, True), (8, True)]


@pytest.mark.parametrize(
    "setting", [["adapter=lora", "precision=bf16"], ["task=causal_lm", "model=llama_tiny"]]
)
@pytest.mark.parametrize("accumulation, checkpointing, gpus", [(4, True, 1), (1, False, 1), (2, False, 2)])
def test_a_candidate_s_config_is_what_composing_its_overrides_gives(
    setting, accumulation, checkpointing, gpus
):
    from effitrain.commands.plan import candidate_config
    from effitrain.config.load import apply_effective_batch_size

    base = compose("optimizer=adafactor", *setting)
    composed = compose("optimizer=adafactor", *setting, "effective_batch_size=16",
                       f"gradient_accumulation_steps={accumulation}",
                       *(["gradient_checkpointing=true"] if checkpointing else []))  # fmt: skip
    apply_effective_batch_size(composed, gpus)
    derived = candidate_config(base, 16, accumulation, {"gradient_checkpointing": True} if checkpointing else {},
                               gpus)  # fmt: skip
    assert derived.micro_batch_size == 16 // (accumulation * gpus)
    assert derived.gradient_checkpointing is checkpointing
    assert run_config(derived) == run_config(composed)
    assert base.gradient_accumulation_steps == 1 and not base.gradient_checkpointing  # a copy was changed


def test_a_lever_s_cost_is_its_recomputed_flops_and_its_offloaded_bytes_out_and_back_at_the_rates():
    """By hand, on the CUDA profile: 4e14 recomputed FLOPs at 400 TFLOP/s are 1 s; 25 GB offloaded per
    micro-batch, out and back, over 2 micro-batches, are 100 GB at 25 GB/s: 4 s. On the CPU nothing
    moves: only the recomputation costs."""
    from effitrain.commands.plan_levers import lever_cost

    row = {"recomputed_flops_per_step": 4 * 10**14, "step_peak_host_offloaded_bytes": 25 * 10**9}
    assert lever_cost(row, 2, "cuda") == {
        "recomputed_flops": 4 * 10**14, "offloaded_bytes": 10**11, "lever_cost_s": 5.0
    }  # fmt: skip
    assert lever_cost(row, 2, "cpu")["lever_cost_s"] == 4 * 10**14 / 100e9
    assert lever_cost({}, 1, "cuda") == {"recomputed_flops": 0, "offloaded_bytes": 0, "lever_cost_s": 0.0}


# a causal Llama of one layer: its logits, upcast loss and attention on CUDA's kernels, in a second
CAUSAL = ["model=tiny", "data=synthetic", "task=causal_lm", "max_length=16", "eval_batch_size=2",
          "model.architecture.num_hidden_layers=1"]  # fmt: skip


@pytest.mark.parametrize(
    "levers",
    [  # the fast selection keeps the replay without a lever
        [],
        *(pytest.param([lever], marks=pytest.mark.slow)
          for lever in ("gradient_checkpointing=true", "loss_chunks=2", "activation_offloading=true")),
    ],  # fmt: skip
    ids=["none", "checkpointing", "chunked_loss", "offloading"],
)
def test_bf16_and_fp16_replay_to_the_same_bytes_in_every_category_and_phase(levers):
    """What lets plan give an fp16 candidate its bf16 twin's figures (``HALF``): two full replays on
    CUDA's kernels, one per half precision, find the same bytes in every category of every phase."""
    found = {}
    for precision in ("bf16", "fp16"):
        cfg = compose(*CAUSAL, f"precision={precision}", *levers, tiny=False)
        [row] = estimate_memory(cfg, {"adamw": cfg.optimizer}, device="cuda", share=False).values()
        found[precision] = {key: row[key] for key in ("step_peak", "run_peak", "step_peak_bytes",
                                                      "run_peak_bytes", "flops_per_step")}  # fmt: skip
        assert row["step_peak_bytes"] > 0 and row["run_peak_bytes"] >= row["step_peak_bytes"]
    assert found["fp16"] == found["bf16"]


def test_an_fp16_candidate_takes_its_bf16_twin_s_figures_and_equals_a_full_replay_of_its_own():
    """The bf16 candidate of a CUDA plan is the fp16 candidate's replay (``trace_source``), fp32's a
    replay of its own (its activations are twice as large); each equals a full replay of its own
    command."""
    from effitrain.commands.plan import HALF_TWIN
    from effitrain.config.load import apply_effective_batch_size

    rows = plan(CAUSAL, 2**40, effective=2, optimizers=["adamw"], precisions=["fp16", "fp32", "bf16"],
                checkpointing=[False], device="cuda")  # fmt: skip
    halves = {(r["precision"], r["optimizer"]): r for r in rows}
    assert sorted(halves) == [("bf16", "adamw"), ("fp16", "adamw"), ("fp32", "adamw")]
    assert halves["bf16", "adamw"]["trace_source"] == HALF_TWIN  # fp16 first: bf16 takes its figures
    assert halves["fp16", "adamw"]["trace_source"] == "shared"
    assert halves["fp32", "adamw"]["trace_source"] == "shared, step reused"  # its optimizer step fp16's
    peak = {precision: halves[precision, "adamw"]["step_peak_bytes_predicted"] for precision in ("fp16", "fp32", "bf16")}
    assert peak["bf16"] == peak["fp16"] != peak["fp32"]
    for (_, name), row in halves.items():
        words = row["command"].split()
        cfg = compose(*words[words.index("train.py") + 1 :], tiny=False)
        apply_effective_batch_size(cfg, 1)
        [full] = estimate_memory(cfg, {name: cfg.optimizer}, device="cuda", share=False).values()
        assert (full["step_peak_bytes"], full["run_peak_bytes"], full["run_peak"]) == (
            row["step_peak_bytes_predicted"], row["run_peak_bytes_predicted"], row["run_peak_predicted"]
        )
