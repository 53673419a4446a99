"""The optimizer step in backward (``optimizer_in_backward=true``) on real runs: the same arithmetic as
the step after backward (bit-identical losses, gradient norms, learning rates and weights on CPU), its
step peak measured equal to the predicted one per category, its gradients category one gradient (the
largest: the embedding's) where the step after backward holds them all, and a resume bit-identical to
the uninterrupted run."""

from __future__ import annotations

import shutil

import pytest
import torch

from effitrain.config.summary_schema import CATEGORIES
from effitrain.train import resume_point
from tests.helpers.run import compose, final_weights, read_metrics, run_job

COMMON = ["max_grad_norm=0", "data.num_train=64", "max_steps=3", "checkpoint_every=3"]
KINDS = {
    "classifier": [],
    # one sequence per micro-batch: the step, not the logits, sets the peak, so gradients are in it
    "causal": ["task=causal_lm", "model=llama_tiny", "max_length=64", "micro_batch_size=1"],
}


def _measured(summary: dict, predicted: bool = False) -> dict:
    suffix = "_predicted" if predicted else ""
    return {c: summary[f"mem/step_peak{suffix}/{c}_bytes"] for c in CATEGORIES}


def _off_and_on(tmp_path, *overrides: str) -> dict:
    runs = {}
    for value in ("false", "true"):
        summary = run_job(tmp_path / value, *COMMON, *overrides, f"optimizer_in_backward={value}")
        assert summary["status"] == "ok", summary.get("error")
        runs[value] = summary
    return runs


def _assert_same_training(tmp_path, runs: dict) -> None:
    off, on = read_metrics(tmp_path / "false"), read_metrics(tmp_path / "true")
    for key in ("train/loss", "grad_norm", "lr"):  # the schedule steps once per optimizer step
        assert [line[key] for line in on] == [line[key] for line in off], key
    assert runs["true"]["eval/loss"] == runs["false"]["eval/loss"]
    a, b = final_weights(tmp_path / "false"), final_weights(tmp_path / "true")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["classifier", pytest.param("causal", marks=pytest.mark.slow)])
def test_it_trains_bit_identically_holds_one_gradient_and_is_predicted_to_the_byte(tmp_path, kind):
    runs = _off_and_on(tmp_path, *KINDS[kind])
    _assert_same_training(tmp_path, runs)
    for value in ("false", "true"):  # measured == predicted, category by category, to the byte
        assert _measured(runs[value]) == _measured(runs[value], predicted=True), value
    # independent counts, from the checkpoint's tensors (every parameter, fp32): the step after
    # backward holds every gradient at its peak; in backward, one at a time, the largest setting it
    weights = final_weights(tmp_path / "true")
    largest = max(t.numel() * t.element_size() for t in weights.values())
    trainable = runs["false"]["mem/params_trainable_bytes"]
    assert runs["false"]["mem/step_peak/gradients_bytes"] == trainable
    assert runs["true"]["mem/step_peak/gradients_bytes"] == largest < trainable
    assert runs["true"]["mem/step_peak_bytes"] < runs["false"]["mem/step_peak_bytes"]
    # every gradient was still seen as it was made (the run's whole-model gradient count)
    assert runs["true"]["mem/grads_bytes"] == runs["false"]["mem/grads_bytes"] == trainable


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adafactor", "lion", "apollo", "adam8bit", "adamw_fused"])
def test_each_per_parameter_optimizer_trains_bit_identically_and_is_predicted(tmp_path, optimizer):
    runs = _off_and_on(tmp_path, f"optimizer={optimizer}")
    _assert_same_training(tmp_path, runs)
    assert _measured(runs["true"]) == _measured(runs["true"], predicted=True)


def test_a_counted_optimizer_state_keeps_the_first_step_s_prediction_an_upper_bound(tmp_path):
    """bitsandbytes' step is traced as SGD and its state counted from the first step's start: with
    the update in backward, state is made parameter by parameter, so the first step is bounded."""
    summary = run_job(
        tmp_path, "max_grad_norm=0", "max_steps=1", "optimizer=adam8bit", "optimizer_in_backward=true"
    )
    assert summary["status"] == "ok", summary.get("error")
    assert summary["mem/step_peak_bytes_predicted"] >= summary["mem/step_peak_bytes"]
    assert summary["mem/step_peak_predicted_bound"].startswith("the optimizer state is counted")


@pytest.mark.slow
def test_a_resumed_run_is_bit_identical_and_its_checkpoint_holds_every_parameter_s_state(tmp_path):
    overrides = ["optimizer_in_backward=true", "max_grad_norm=0", "max_steps=4", "checkpoint_every=2",
                 "checkpoint_keep=3"]  # fmt: skip
    reference = tmp_path / "reference"
    assert run_job(reference, *overrides)["status"] == "ok"
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "summary.json").unlink()
    shutil.rmtree(run_dir / "checkpoints" / "step-00000004")  # as if killed after step 2's checkpoint
    summary = run_job(run_dir, *overrides, "resume=auto")
    assert summary["status"] == "ok", summary.get("error")
    assert summary["train/resumed_from_step"] == 2 and summary["train/steps"] == 4
    a, b = final_weights(run_dir), final_weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [line["train/loss"] for line in read_metrics(run_dir)] == [
        line["train/loss"] for line in read_metrics(reference)
    ]
    # step 2's optimizer state: AdamW's two moments for every trainable parameter, each its shape
    _, folder = resume_point.list_checkpoints(run_dir)[0]
    state = torch.load(folder / "optimizer.pt", weights_only=True)
    state = state.get("state", state.get("optimizer", {}).get("state")) if isinstance(state, dict) else None
    shapes = [tuple(t.shape) for t in final_weights(reference).values()]
    assert state is not None and len(state) == len(shapes)
    assert sorted(tuple(s["exp_avg"].shape) for s in state.values()) == sorted(shapes)
    assert all(float(s["step"]) == 2 for s in state.values())


def test_the_shared_replay_of_several_optimizers_holds_one_gradient_with_it_and_all_without():
    from effitrain.commands.estimate import meta_model, replay_shapes
    from effitrain.memory.shared_traces import trace_runs

    # 4 tokens: the later step, not the activations, sets the peak
    overrides = ["model=tiny", "max_length=4", "micro_batch_size=1", "max_grad_norm=0"]
    for value in ("false", "true"):
        cfg = compose(*overrides, f"optimizer_in_backward={value}")
        optimizers = {name: compose(*overrides, f"optimizer={name}").optimizer for name in ("adamw", "lion")}
        model = meta_model(cfg)
        sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
        batches, evaluation = replay_shapes(cfg, model)
        traces = trace_runs(model.config, optimizers, cfg, batches, "cpu", evaluation)
        expected = max(sizes) if value == "true" else sum(sizes)
        for name, trace in traces.items():
            assert trace.phases["later_step"]["gradients"] == expected, (value, name)


def test_a_replay_of_a_setting_it_cannot_run_with_is_refused_in_one_line_not_predicted():
    """``plan`` composes candidates past validation (accumulation above 1): the replay refuses them
    as a run would, rather than predicting a step that never runs."""
    from effitrain.commands.estimate import meta_model, replay_shapes
    from effitrain.config.errors import ConfigError
    from effitrain.memory.replay import trace_run

    cfg = compose(
        "max_length=4", "max_grad_norm=0", "optimizer_in_backward=true", "gradient_accumulation_steps=2"
    )
    model = meta_model(cfg)
    batches, evaluation = replay_shapes(cfg, model)
    with pytest.raises(
        ConfigError, match=r"^gradient_accumulation_steps=2 is invalid: with optimizer_in_backward"
    ):
        trace_run(model.config, cfg.optimizer, cfg, batches, "cpu", evaluation)


@pytest.mark.slow
def test_plan_proposes_it_where_it_is_what_makes_the_budget_fit():
    """A causal LM whose step, not its activations, sets the peak (16 tokens, one sequence): between
    the run peaks with and without it, only the step in backward fits; checkpointing does not help."""
    from effitrain.commands.estimate import estimate_memory
    from effitrain.commands.plan import plan

    base = ["task=causal_lm", "model=llama_tiny", "data=synthetic", "max_length=16", "eval_batch_size=1",
            "max_grad_norm=0", "micro_batch_size=1"]  # fmt: skip
    peaks = {}
    for value in (False, True):
        cfg = compose(*base, f"optimizer_in_backward={str(value).lower()}", tiny=False)
        [row] = estimate_memory(cfg, {"adamw": cfg.optimizer}).values()
        peaks[value] = row["run_peak_bytes"]
    assert peaks[False] - peaks[True] >= 3_000_000  # an embedding-sized gradient less (3.9 MB)
    budget = (peaks[False] + peaks[True]) // 2
    rows = plan(base, budget, effective=1, optimizers=["adamw"], precisions=["fp32"], margin=0.0)
    best = rows[0]
    assert best["fits"] and best["levers"] == {"optimizer_in_backward": True}
    assert best["run_peak_bytes_predicted"] == peaks[True]
    assert "optimizer_in_backward=true" in best["command"]
    assert not any(row["fits"] for row in rows if not row["levers"].get("optimizer_in_backward"))


@pytest.mark.slow
def test_an_adapter_s_trainable_weights_alone_are_updated_in_backward_as_after_it(tmp_path):
    runs = _off_and_on(tmp_path, "adapter=lora")
    off, on = read_metrics(tmp_path / "false"), read_metrics(tmp_path / "true")
    assert [line["train/loss"] for line in on] == [line["train/loss"] for line in off]
    assert [line["grad_norm"] for line in on] == [line["grad_norm"] for line in off]
    assert runs["true"]["eval/loss"] == runs["false"]["eval/loss"]
    assert _measured(runs["true"]) == _measured(runs["true"], predicted=True)
    assert runs["true"]["mem/grads_bytes"] == runs["true"]["mem/params_trainable_bytes"]
