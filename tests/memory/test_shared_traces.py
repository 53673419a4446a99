"""The shared replay (effitrain.memory.shared_traces): every optimizer's trace from one forward and
backward equals a full trace of that optimizer alone, phase by phase and category by category."""

from __future__ import annotations

import pytest

from effitrain.commands.estimate import meta_model, replay_shapes
from effitrain.config.registry import group_options, installed_optimizers
from effitrain.memory.replay import trace_run
from effitrain.memory.shared_traces import StepReplays, trace_runs
from tests.helpers.run import CAUSAL_BF16_CHECKPOINTING, compose

OPTIMIZERS = installed_optimizers(group_options("optimizer"))

CASES = {  # (device profile, overrides): each axis the forward and backward depend on
    "classification": ("cpu", ["model=tiny", "max_length=64"]),
    "causal_lm": ("cpu", ["task=causal_lm", "model=llama_tiny", "max_length=64"]),
    "checkpointing": ("cpu", ["model=tiny", "max_length=64", "gradient_checkpointing=true"]),
    "accumulation_2_bf16": (
        "cpu",
        ["model=tiny", "max_length=64", "gradient_accumulation_steps=2", "precision=bf16"],
    ),  # fmt: skip
    "cuda": ("cuda", ["model=tiny", "max_length=64"]),
    # an adapter: its frozen weights, its dead DoRA graph, a 4-bit base counted beside the replay
    "lora": ("cpu", ["model=tiny", "max_length=64", "adapter=lora"]),
    "dora_causal": ("cpu", ["task=causal_lm", "model=llama_tiny", "max_length=64", "adapter=dora"]),
    "qlora": ("cpu", ["model=tiny", "max_length=64", "adapter=qlora"]),
    # micro-batches left out of the replay, and the batch tensors MemTracker counts (the labels' views)
    "cuda_causal_accumulation_6": (
        "cuda",
        ["task=causal_lm", "model=llama_tiny", "max_length=32", "gradient_accumulation_steps=6"],
    ),  # fmt: skip
    "cuda_causal_bf16_checkpointing": ("cuda", [*CAUSAL_BF16_CHECKPOINTING, "gradient_accumulation_steps=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_each_optimizer_s_shared_trace_is_its_full_trace_to_the_byte(case):
    device, overrides = CASES[case]
    cfg = compose(*overrides)
    optimizers = {name: compose(*overrides, f"optimizer={name}").optimizer for name in OPTIMIZERS}
    model = meta_model(cfg)
    batches, evaluation = replay_shapes(cfg, model)
    shared = trace_runs(model.config, optimizers, cfg, batches, device, evaluation)
    assert list(shared) == OPTIMIZERS
    for name, optimizer_cfg in optimizers.items():
        full = trace_run(model.config, optimizer_cfg, cfg, batches, device, evaluation)
        assert list(shared[name].phases) == ["first_step", "later_step", "eval"]
        for phase, peak in full.phases.items():
            assert shared[name].phases[phase] == peak, (name, phase)
        assert (shared[name].flops, shared[name].bounds) == (full.flops, full.bounds), name


def test_the_step_s_own_peak_is_composed_where_it_exceeds_the_backward_s():
    """A case where the optimizer step sets a phase's peak and one where the backward does, both
    found: AdamW's later step on a model of few activations (4 tokens) holds two moments and its
    temporaries above the backward's peak; with 512 tokens the backward's activations dominate."""
    for max_length, step_sets_peak in ((4, True), (512, False)):
        overrides = ["model=tiny", f"max_length={max_length}", "optimizer=adamw", "eval_batch_size=1"]
        cfg = compose(*overrides)
        model = meta_model(cfg)
        batches, evaluation = replay_shapes(cfg, model)
        [shared] = trace_runs(
            model.config, {"adamw": cfg.optimizer}, cfg, batches, "cpu", evaluation
        ).values()
        full = trace_run(model.config, cfg.optimizer, cfg, batches, "cpu", evaluation)
        assert shared == full
        later = full.phases["later_step"]
        # at the step's peak the activations are gone (freed by the backward): only the residue remains
        assert (later["activations"] < later["optimizer_state"]) == step_sets_peak, later


@pytest.mark.slow
def test_a_step_reused_across_micro_batches_precisions_and_checkpointing_is_the_full_trace():
    """plan's candidates of one optimizer share its step (StepReplays): replayed for the first,
    reused for every later candidate whose gradients match; each equals a full trace of its own."""
    steps = StepReplays()
    names = ["adamw", "adafactor", "apollo"]
    for index, overrides in enumerate([
        ["micro_batch_size=4"], ["micro_batch_size=2", "gradient_accumulation_steps=2"],
        ["micro_batch_size=4", "precision=bf16"], ["micro_batch_size=1", "gradient_checkpointing=true"],
    ]):  # fmt: skip
        overrides = ["model=tiny", "max_length=32", *overrides]
        cfg = compose(*overrides)
        optimizers = {name: compose(*overrides, f"optimizer={name}").optimizer for name in names}
        model = meta_model(cfg)
        batches, evaluation = replay_shapes(cfg, model)
        shared = trace_runs(model.config, optimizers, cfg, batches, "cpu", evaluation, steps)
        assert steps.reused == (set(names) if index else set())
        for name, optimizer_cfg in optimizers.items():
            assert shared[name] == trace_run(model.config, optimizer_cfg, cfg, batches, "cpu", evaluation), (
                name
            )


def test_a_record_whose_later_step_saw_other_gradients_is_never_reused_for_it():
    """A step replayed for an earlier candidate is reused only where its gradients match, phase by
    phase: a record that matches the first step's gradients but was made on other gradients for the
    later step (its later step planted here with figures no step holds) is not reused for that
    step; the candidate is replayed in full, and equals its full trace."""
    overrides = ["model=tiny", "max_length=8", "micro_batch_size=2", "eval_batch_size=1"]
    cfg = compose(*overrides)
    model = meta_model(cfg)
    batches, evaluation = replay_shapes(cfg, model)
    steps = StepReplays()
    trace_runs(model.config, {"adamw": cfg.optimizer}, cfg, batches, "cpu", evaluation, steps)
    [record] = steps.records.values()
    state, delta, bounded = record["later_step"]
    record["later_step"] = ({k: v + 10**9 for k, v in state.items()}, delta, bounded)
    record["later_step_signature"] = ("other gradients",)
    [again] = trace_runs(
        model.config, {"adamw": cfg.optimizer}, cfg, batches, "cpu", evaluation, steps
    ).values()
    full = trace_run(model.config, cfg.optimizer, cfg, batches, "cpu", evaluation)
    assert again == full and again.phases["later_step"]["total"] < 10**9
    assert steps.reused == set()  # replayed, not reused


def test_inside_plan_s_search_one_eval_phase_serves_every_micro_batch_and_optimizer(monkeypatch):
    """Evaluation runs neither the optimizer nor a training batch: inside ``reused_in_search`` (plan's
    search) a candidate that differs only in its micro batch and accumulation reuses the eval phase
    traced for another, each optimizer's eval figures equal to a fresh trace's (its own state added);
    another precision traces its own."""
    from effitrain.memory import fake_window, shared_traces

    traced, own = [], shared_traces._eval_phase
    monkeypatch.setattr(shared_traces, "_eval_phase", lambda replay: traced.append(1) or own(replay))

    def traces(*overrides):
        common = ["model=tiny", "max_length=16", "model.architecture.num_hidden_layers=1", *overrides]
        nodes = {name: compose(*common, f"optimizer={name}").optimizer for name in ("adamw", "lion")}
        cfg = compose(*common)
        model = meta_model(cfg)
        batches, evaluation = replay_shapes(cfg, model)
        return trace_runs(model.config, nodes, cfg, batches, "cpu", evaluation)

    with fake_window.reused_in_search():
        traces("micro_batch_size=2")
        reused = traces("micro_batch_size=4", "gradient_accumulation_steps=2")
        assert len(traced) == 1
        traces("micro_batch_size=4", "precision=bf16")
        assert len(traced) == 2
    fresh = traces("micro_batch_size=4", "gradient_accumulation_steps=2")
    assert len(traced) == 3
    for name in ("adamw", "lion"):
        assert reused[name].phases["eval"] == fresh[name].phases["eval"], name
    # the state held through evaluation is each optimizer's: AdamW's two moments and a float32 step
    # count per parameter tensor, Lion's one moment (the weights' size)
    states = {name: reused[name].phases["eval"]["optimizer_state"] for name in ("adamw", "lion")}
    parameters = list(meta_model(compose("model=tiny", "model.architecture.num_hidden_layers=1")).parameters())
    assert states["lion"] == sum(4 * p.numel() for p in parameters)
    assert states["adamw"] == 2 * states["lion"] + 4 * len(parameters)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_levers_that_train_only_leave_the_eval_phase_as_it_is(device):
    """Activation offloading and the optimizer step in backward act in training only: a full replay's
    eval phase is the same bytes with each on as with neither (what lets plan's search share one eval
    phase across them). Gradient checkpointing is not among them: its eval phase holds 49,152 bytes
    more here, and the chunked loss is the loss evaluation computes too."""
    from effitrain.memory.shared_traces import TRAINING_ONLY

    common = ["task=causal_lm", "model=llama_tiny", "max_length=64", "model.architecture.num_hidden_layers=4",
              "precision=bf16", "eval_batch_size=6", "max_grad_norm=0"]  # fmt: skip

    def eval_phase(*overrides):
        cfg = compose(*common, *overrides)
        model = meta_model(cfg)
        batches, evaluation = replay_shapes(cfg, model)
        return trace_run(model.config, cfg.optimizer, cfg, batches, device, evaluation).phases["eval"]

    plain = eval_phase()
    assert {t.key for t in TRAINING_ONLY} == {"activation_offloading", "optimizer_in_backward"}
    assert eval_phase("optimizer_in_backward=true") == plain
    if device == "cuda":  # a CPU run offloads nothing
        assert eval_phase("activation_offloading=true") == plain
        assert eval_phase("activation_offloading=true", "gradient_checkpointing=true") == eval_phase(
            "gradient_checkpointing=true"
        )
    assert eval_phase("gradient_checkpointing=true")["activations"] == plain["activations"] + 49_152
    assert eval_phase("loss_chunks=4")["activations"] != plain["activations"]
