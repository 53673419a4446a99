"""The replay of an accumulation window (effitrain.memory.replay): a micro-batch that repeats the one
before it is left out, and the window's peaks, bounds and FLOPs stay those of replaying every one."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config

from effitrain.commands.estimate import meta_model, replay_shapes
from effitrain.memory import fake_window
from effitrain.memory.fake_window import replayed_as
from effitrain.memory.replay import trace_run
from effitrain.memory.sharded import trace_sharded
from effitrain.memory.step_peak import CATEGORIES
from effitrain.util import compat
from effitrain.util.compat import counting_like
from tests.helpers.run import CAUSAL_BF16_CHECKPOINTING, compose, run_job


def test_only_the_inside_of_a_run_of_equal_micro_batches_is_left_out():
    a, b = {"input_ids": ((2, 8), torch.int64)}, {"input_ids": ((2, 5), torch.int64)}
    assert replayed_as([a] * 5) == [0, 0, 0, 0, 4]
    assert replayed_as([a] * 16) == [0] * 15 + [15]
    assert replayed_as([a] * 2) == [0, 1]  # a run's first and last stay
    assert replayed_as([a, a, a, b, b, b, a, a]) == [0, 0, 2, 3, 3, 5, 6, 7]
    # padding decides the attention mask's path: the same shapes with another flag are no repeat
    assert replayed_as([a, a, a, {**a, "padded": True}, a, a, a]) == [0, 0, 2, 3, 4, 4, 6]
    # a sharded step synchronizes in the last: the one before it ends the run
    assert replayed_as([a] * 5, synchronized_last=True) == [0, 0, 0, 3, 4]
    assert replayed_as([a] * 3, synchronized_last=True) == [0, 1, 2]


def every_micro_batch(monkeypatch):
    monkeypatch.setattr(fake_window, "replayed_as", lambda batches, *sharded: list(range(len(batches))))


CASES = {  # (device profile, overrides), each with an accumulation window of 6: four left out
    "classification": ("cpu", ["model=tiny", "max_length=64", "optimizer=adamw", "model.architecture.num_hidden_layers=1"]),
    "cuda_causal_bf16_checkpointing": ("cuda", CAUSAL_BF16_CHECKPOINTING),
    "lora_8bit_adam": ("cpu", ["model=tiny", "max_length=64", "adapter=lora", "optimizer=adam8bit"]),
}


# the classification case in the fast selection, the other profiles' in the full suite (the same shortcut)
@pytest.mark.parametrize(
    "case",
    [case if case == "classification" else pytest.param(case, marks=pytest.mark.slow) for case in CASES],
)
def test_leaving_out_the_repeats_changes_no_byte_bound_or_flop(case, monkeypatch):
    device, overrides = CASES[case]
    cfg = compose(*overrides, "gradient_accumulation_steps=6")
    model = meta_model(cfg)
    batches, evaluation = replay_shapes(cfg, model)
    assert counting_like() is not None and replayed_as(batches) == [0, 0, 0, 0, 0, 5]
    left_out = trace_run(model.config, cfg.optimizer, cfg, batches, device, evaluation)
    every_micro_batch(monkeypatch)
    full = trace_run(model.config, cfg.optimizer, cfg, batches, device, evaluation)
    assert left_out.phases == full.phases
    assert (left_out.flops, left_out.bounds) == (full.flops, full.bounds)
    # the FLOPs of the window are six micro-batches' (no repeat counted as nothing)
    single = trace_run(model.config, cfg.optimizer, cfg, batches[:1], device, evaluation)
    assert full.flops == 6 * single.flops > 0


def test_the_batch_tensors_a_left_out_micro_batch_would_have_had_counted_are_counted(monkeypatch):
    """GPT-2's forward views its input ids and mask, a causal LM's loss its labels: MemTracker then
    counts each micro-batch's tensors from that moment on. Left out without them, the step is lower."""
    cfg = compose("task=causal_lm", "model=llama_tiny", "optimizer=adamw")
    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    shape = ((2, 32), torch.int64)
    batch = {"input_ids": shape, "attention_mask": shape, "labels": shape, "padded": True}
    left_out = trace_run(config, cfg.optimizer, cfg, [batch] * 6, "cuda", batch)
    with monkeypatch.context() as patched:
        patched.setattr(compat, "counting_like", lambda: lambda tracker, tensor, like: None)
        uncounted = trace_run(config, cfg.optimizer, cfg, [batch] * 6, "cuda", batch)
    every_micro_batch(monkeypatch)
    full = trace_run(config, cfg.optimizer, cfg, [batch] * 6, "cuda", batch)
    assert left_out.phases == full.phases
    # four micro-batches left out, three tensors each counted in one 512-byte CUDA block
    for phase in ("first_step", "later_step"):
        assert full.phases[phase]["total"] - uncounted.phases[phase]["total"] == 4 * 3 * 512, phase


def test_a_window_of_changing_shapes_and_padding_is_replayed_as_in_full(monkeypatch):
    cfg = compose("task=causal_lm", "model=llama_tiny", "optimizer=adamw", "model.architecture.num_hidden_layers=1")
    model = meta_model(cfg)

    def batch(rows, tokens, padded):
        shape = ((rows, tokens), torch.int64)
        return {"input_ids": shape, "attention_mask": shape, "labels": shape, "padded": padded}

    long, short = batch(2, 48, True), batch(2, 16, False)
    batches = [long] * 4 + [short] * 4 + [long, batch(1, 16, True)]
    assert replayed_as(batches) == [0, 0, 0, 3, 4, 4, 4, 7, 8, 9]
    left_out = trace_run(model.config, cfg.optimizer, cfg, batches, "cpu", short)
    every_micro_batch(monkeypatch)
    full = trace_run(model.config, cfg.optimizer, cfg, batches, "cpu", short)
    assert (left_out.phases, left_out.flops) == (full.phases, full.flops)


def test_a_sharded_window_keeps_its_synchronizing_last_micro_batch(monkeypatch):
    cfg = compose("task=causal_lm", "model=llama_tiny", "parallel=fsdp", "optimizer=adamw", "max_length=32",
                  "model.architecture.num_hidden_layers=1")  # fmt: skip
    model = meta_model(cfg)
    batches = replay_shapes(cfg, model)[0] * 6
    left_out = trace_sharded(model.config, cfg.optimizer, cfg, batches, "cpu", world_size=2)
    every_micro_batch(monkeypatch)
    full = trace_sharded(model.config, cfg.optimizer, cfg, batches, "cpu", world_size=2)
    assert (left_out.phases, left_out.fsdp_phases, left_out.at_update) == (
        full.phases,
        full.fsdp_phases,
        full.at_update,
    )
    assert left_out.flops == full.flops


def test_a_real_step_of_six_equal_causal_micro_batches_is_predicted_to_the_byte(tmp_path):
    """Packed rows: every micro-batch is 2 x 16 tokens, so the replay of the tracked step leaves four
    out; the prediction is still the real step's, category by category."""
    summary = run_job(tmp_path, "task=causal_lm", "model=llama_tiny", "data=synthetic", "data.packing=true",
                      "max_length=16", "micro_batch_size=2", "gradient_accumulation_steps=6", "max_steps=2",
                      "logger=none", "progress_bar=false", tiny=False)  # fmt: skip
    assert summary["status"] == "ok", summary["error"]
    measured = {c: summary[f"mem/step_peak/{c}_bytes"] for c in CATEGORIES}
    predicted = {c: summary[f"mem/step_peak_predicted/{c}_bytes"] for c in CATEGORIES}
    assert predicted == measured
    assert measured["activations"] > 0 and measured["optimizer_state"] > 0  # a later step was tracked


def test_one_flop_count_serves_every_precision_and_optimizer(monkeypatch):
    """Inside ``fake_window.reused_in_search`` (plan's search) a replay's FLOPs are counted once per model,
    batch shapes, device and techniques and reused for other precisions and optimizers: the reused
    count equals a fresh one (the memo emptied), the recomputed FLOPs of selective checkpointing and
    the chunked loss too, and the reuse is taken. Outside it every replay counts its own (so two
    paths a test compares are two counts)."""
    from effitrain.memory import replay

    base = [
        "task=causal_lm",
        "model=llama_tiny",
        "max_length=64",
        "gradient_checkpointing=2",
        "loss_chunks=4",
    ]
    counted = []
    monkeypatch.setattr(replay, "window_flops", lambda *a: counted.append(1) or fake_window.window_flops(*a))

    def traced(precision, optimizer, *levers):
        cfg = compose(*base, f"precision={precision}", f"optimizer={optimizer}", *levers, tiny=False)
        model = meta_model(cfg)
        with replay.replayed(model.config, cfg, replay_shapes(cfg, model)[0], "cuda") as replayed:
            return replayed.flops, replayed.recomputed_flops  # counted as the replay is made

    with fake_window.reused_in_search():
        first = traced("fp32", "adamw")
        reused = traced("bf16", "lion")
        assert len(counted) == 2  # the first trace's two counts, none for the second
        fake_window._REUSED.clear()
        fresh = traced("bf16", "lion")
    assert reused == fresh == first and fresh[1] > 0 and len(counted) == 4
    with (
        fake_window.reused_in_search()
    ):  # another technique setting: the model's count shared, its own recomputed
        traced("fp32", "adamw")
        every_block = traced("fp32", "adamw", "gradient_checkpointing=true")
        assert len(counted) == 4 + 2 + 1
    assert every_block[0] == first[0] and every_block[1] > first[1]
    counted.clear()
    traced("bf16", "lion")
    assert len(counted) == 2 and fake_window._REUSED is None  # outside: counted again


def test_the_chunked_loss_s_model_flops_are_its_own_inside_plan_s_search():
    """The chunked loss runs the LM head on the positions that have a target only (a row's last has
    none): its model FLOPs are below the plain loss's, and inside plan's search neither count serves
    the other (each equals a fresh count outside it)."""
    from effitrain.memory import replay

    def traced(chunks: int):
        cfg = compose("task=causal_lm", "model=llama_tiny", "max_length=64", f"loss_chunks={chunks}", tiny=False)
        model = meta_model(cfg)
        with replay.replayed(model.config, cfg, replay_shapes(cfg, model)[0]) as replayed:
            return replayed.flops, replayed.recomputed_flops

    with fake_window.reused_in_search():
        searched = {chunks: traced(chunks) for chunks in (1, 4)}
    fresh = {chunks: traced(chunks) for chunks in (1, 4)}
    assert searched == fresh
    assert fresh[4][0] < fresh[1][0] and fresh[1][1] == 0 < fresh[4][1]
