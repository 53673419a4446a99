"""``effitrain estimate``'s engine: what it asks the replay for (the replay itself is tested in
tests/memory)."""

from __future__ import annotations

import pytest
import torch

from effitrain.commands.estimate import estimate_memory
from tests.helpers.run import compose


def test_estimate_traces_the_worst_case_step_and_an_evaluation_of_eval_batch_size(monkeypatch):
    """Every micro-batch max_length tokens, gradient_accumulation_steps of them, and the eval phase
    at eval_batch_size x max_length rows (12 x 40 here, not the micro batch's 4)."""
    import effitrain.memory.shared_traces
    from effitrain.memory.replay import Trace

    asked = []

    def replay(config, optimizer_cfgs, cfg, batches, device, eval_shapes, steps=None):
        asked.append((batches, device, eval_shapes))
        peak = dict.fromkeys(["weights", "gradients", "optimizer_state", "activations", "temporaries"], 0)
        peak["total"] = 1
        return {
            name: Trace({"first_step": peak, "later_step": peak, "eval": peak}, 1) for name in optimizer_cfgs
        }

    monkeypatch.setattr(effitrain.memory.shared_traces, "trace_runs", replay)
    cfg = compose(
        "max_length=40", "micro_batch_size=4", "eval_batch_size=12", "gradient_accumulation_steps=3"
    )
    estimate_memory(cfg)

    def shapes(rows: int) -> dict:
        tokens = ((rows, 40), torch.int64)
        return {"input_ids": tokens, "attention_mask": tokens, "labels": ((rows,), torch.int64),
                "token_type_ids": tokens, "padded": True}  # fmt: skip

    [(batches, device, evaluation)] = asked
    assert batches == [shapes(4)] * 3 and device == "cpu"
    assert evaluation == shapes(12)


@pytest.mark.parametrize(
    "setting", [["model=tiny"], ["task=causal_lm", "model=llama_tiny"], ["no segment ids"]]
)
def test_the_replayed_batch_holds_the_keys_the_run_s_collator_makes(setting, tmp_path):
    """The estimate's batch against the collator's own output on the run's tokenized rows: a
    classifier's holds the segment ids its tokenizer returns, whatever the model's config says
    (the tiny BERT's tokenizer saved without them, beside its config's type_vocab_size 2, as
    RoBERTa's is); a causal LM's none."""
    from transformers import AutoTokenizer

    from effitrain.commands.estimate import meta_model, replay_shapes
    from effitrain.train.modeling import build_tokenizer
    from effitrain.train.tasks import build_task

    if setting == ["no segment ids"]:
        source = build_tokenizer(compose().model).name_or_path
        AutoTokenizer.from_pretrained(
            source, model_input_names=["input_ids", "attention_mask"]
        ).save_pretrained(tmp_path)
        setting = [f"model.tokenizer={tmp_path}"]
    cfg = compose(*setting, "data=synthetic", "max_length=16")
    task, tokenizer = build_task(cfg), build_tokenizer(cfg.model)
    tokenized = task.tokenize(task.load(cfg.data), tokenizer, cfg.max_length)
    collated = task.collator(tokenizer)([tokenized["train"][i] for i in range(2)])
    [batch, *_], evaluation = replay_shapes(cfg, meta_model(cfg))
    assert set(batch) - {"padded"} == set(evaluation) - {"padded"} == set(collated)


@pytest.mark.slow
def test_the_estimate_of_packed_rows_equals_the_run_category_by_category(tmp_path):
    """Packed rows are every one max_length tokens with no padding: the model skips its mask, in the
    run and in the estimate alike, so the estimate (the worst case) is the run's step to the byte."""
    from effitrain.config.summary_schema import CATEGORIES
    from tests.helpers.run import run_job

    setting = ["task=causal_lm", "model=llama_tiny", "data.packing=true", "max_length=32", "micro_batch_size=4",
               "gradient_accumulation_steps=2"]  # fmt: skip
    summary = run_job(tmp_path, *setting, "max_steps=3", "data.words_per_text=80")
    assert summary["status"] == "ok", summary.get("error")
    [row] = estimate_memory(compose(*setting)).values()
    assert row["step_peak"] == {f"{c}_bytes": summary[f"mem/step_peak/{c}_bytes"] for c in CATEGORIES}


def test_with_fsdp_each_row_is_one_rank_of_the_world_size_and_a_refused_optimizer_is_named(monkeypatch):
    """parallel=fsdp: the same phases asked of trace_sharded, with --world-size; an optimizer FSDP
    refuses gets its reason instead of figures, and the other rows stand."""
    import effitrain.memory.sharded
    from effitrain.memory.replay import Trace

    asked = []
    real = effitrain.memory.sharded.trace_sharded

    def sharded(config, optimizer_cfg, cfg, batches, device, eval_shapes, *, world_size):
        asked.append((optimizer_cfg._target_, world_size, device, len(batches)))
        if optimizer_cfg._target_.startswith("transformers"):
            return real(config, optimizer_cfg, cfg, batches, device, eval_shapes, world_size=world_size)
        peak = dict.fromkeys(["weights", "gradients", "optimizer_state", "activations", "temporaries"], 0)
        return Trace({"later_step": {**peak, "total": world_size}}, 1)

    monkeypatch.setattr(effitrain.memory.sharded, "trace_sharded", sharded)
    cfg = compose("parallel=fsdp", "gradient_accumulation_steps=2")
    optimizers = {"adamw": cfg.optimizer, "adafactor": compose("optimizer=adafactor").optimizer}
    rows = estimate_memory(cfg, optimizers, device="cuda", world_size=8)
    assert asked == [
        ("torch.optim.AdamW", 8, "cuda", 2),
        ("transformers.optimization.Adafactor", 8, "cuda", 2),
    ]
    assert rows["adamw"]["step_peak_bytes"] == 8
    assert rows["adafactor"]["unsupported"].startswith(
        "optimizer._target_='transformers.optimization.Adafactor' is invalid with parallel=fsdp"
    )
    assert "step_peak_bytes" not in rows["adafactor"]
    # the counted totals are the whole model's, named so beside one rank's peak (not weights_bytes)
    params = rows["adamw"]["params"]
    assert "weights_bytes" not in rows["adamw"] and rows["adamw"]["whole_model_weights_bytes"] == 4 * params
    assert rows["adamw"]["whole_model_optimizer_state_bytes"] >= 8 * params


# tiny's Linear layers (in, out): per BERT layer query, key, value, attention output, intermediate,
# output; two layers. peft's all-linear adapts each; the head, the pooler (32 -> 32) and the classifier
# (32 -> 3, the data's three labels), trains in full as peft's modules_to_save, a copy beside the original.
TINY_LINEARS = [(32, 32)] * 4 + [(32, 64), (64, 32)]
TINY_LINEARS = TINY_LINEARS * 2
HEAD = 32 * 32 + 32 + 32 * 3 + 3


def test_estimate_counts_what_an_adapter_trains_and_a_4bit_base_holds():
    """LoRA's trained parameters: r x (in + out) per adapted Linear, and the head; QLoRA's weights:
    each quantized Linear's fp32 weight replaced by its packed 4-bit codes (two per byte)."""
    full = estimate_memory(compose(), step=False)["chosen"]
    lora = estimate_memory(compose("adapter=lora", "adapter.r=4"), step=False)["chosen"]
    assert lora["params_trainable"] == sum(4 * (i + o) for i, o in TINY_LINEARS) + HEAD == 4739
    adapters = lora["params"] - full["params"] - HEAD  # the head's copy is new as well
    assert adapters == sum(4 * (i + o) for i, o in TINY_LINEARS)
    assert lora["weights_bytes"] == 4 * lora["params"]
    trained_tensors = 2 * len(TINY_LINEARS) + 4  # A and B per adapted Linear, the head's weights and biases
    assert lora["optimizer_state_bytes"] == 8 * lora["params_trainable"] + 4 * trained_tensors  # AdamW

    qlora = estimate_memory(compose("adapter=qlora", "adapter.r=4"), step=False)["chosen"]
    quantized = sum(i * o for i, o in TINY_LINEARS)
    assert qlora["params_trainable"] == lora["params_trainable"]
    assert qlora["weights_bytes"] == lora["weights_bytes"] - 4 * quantized + quantized // 2


def test_a_cached_estimate_builds_no_optimizer_and_gives_the_rows_counted_without_the_cache(
    tmp_path, monkeypatch
):
    """The counted figures (parameters, weights, gradients, optimizer state) are kept beside the
    traces: a second call builds no optimizer (building one imports its library: transformers'
    Adafactor imports peft and bitsandbytes) and gives the rows a call without the cache counts."""
    import effitrain.train.optim

    monkeypatch.setenv("EFFITRAIN_CACHE_DIR", str(tmp_path))
    overrides = ["model=tiny", "max_length=16", "eval_batch_size=2"]
    cfg = compose(*overrides)
    optimizers = {name: compose(*overrides, f"optimizer={name}").optimizer for name in ("adamw", "adafactor")}
    counted = estimate_memory(cfg, optimizers, step=False)
    assert not (tmp_path / "traces").exists()
    assert estimate_memory(cfg, optimizers, step=False, cache=True) == counted
    assert len(list((tmp_path / "traces").glob("*.json"))) == 2  # one entry per optimizer

    def no_build(*args):
        raise AssertionError("an optimizer was built although its figures were cached")

    monkeypatch.setattr(effitrain.train.optim, "build_optimizer", no_build)
    assert estimate_memory(cfg, optimizers, step=False, cache=True) == counted
    assert counted["adamw"]["optimizer_state_bytes"] != counted["adafactor"]["optimizer_state_bytes"]


def test_the_fsdp_prediction_follows_reshard_after_forward():
    """ZeRO-2 (reshard_after_forward=false) keeps each block's gathered weights from its forward to its
    backward; ZeRO-3 frees them after the forward and gathers again: one rank's predicted weights at the
    step peak are larger without resharding, by at most the unsharded blocks' weights (a prediction that
    ignored the key gave equal figures). The peak falls at another moment of the step with each, so it
    is compared whole, not category by category."""
    figures = {}
    for reshard in ("true", "false"):
        cfg = compose("parallel=fsdp", f"parallel.reshard_after_forward={reshard}")
        [row] = estimate_memory(cfg, world_size=2).values()
        figures[reshard] = row
    zero3, zero2 = figures["true"], figures["false"]
    whole = zero3["whole_model_weights_bytes"]
    assert 0 < zero2["step_peak_bytes"] - zero3["step_peak_bytes"] <= whole
    assert zero2["run_peak"]["later_step_bytes"] > zero3["run_peak"]["later_step_bytes"]
