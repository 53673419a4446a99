"""Adapters (effitrain/train/adapters.py): what LoRA, DoRA and QLoRA train and hold, counted by hand
from the tiny model's config, and the optimizer state of the adapter alone equal to its estimate."""

from __future__ import annotations

import math

import pytest
import torch

from effitrain import memory
from effitrain.config.registry import group_options
from effitrain.train.adapters.build import apply_adapter, parameter_counts
from effitrain.train.adapters.configs import quantization_config
from effitrain.train.optim import build_optimizer
from effitrain.train.tasks import build_task
from tests.helpers.run import compose, optimizer_option, run_job

OPTIONS = [optimizer_option(name) for name in group_options("optimizer")]
NUM_LABELS = 3  # data=synthetic's default
BLOCK = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights
NESTED_BLOCK = 256  # double quantization: one fp32 absmax per 256 absmax values


def adapted(*overrides: str):
    """The tiny classifier of ``compose(*overrides)``, built and wrapped as a run does, and its config."""
    model, cfg, task = loaded(*overrides)
    return apply_adapter(model, cfg.adapter, task), cfg


def loaded(*overrides: str):
    """The tiny model of ``compose(*overrides)`` as a run loads it (4-bit under qlora), before its
    adapter; its config and task."""
    cfg = compose(*overrides)
    task = build_task(cfg)
    raw = task.load(cfg.data)
    quantization = quantization_config(cfg.adapter, cfg.precision.mixed_precision)
    return task.build_model(cfg.model, raw, None, quantization=quantization), cfg, task


def linear_shapes(architecture) -> list[tuple[int, int]]:
    """(in, out) of every Linear of the tiny BERT that LoRA targets (all but the head), from its config."""
    h, i = architecture.hidden_size, architecture.intermediate_size
    per_layer = [(h, h)] * 4 + [(h, i), (i, h)]  # query, key, value, attention output; intermediate, output
    return per_layer * architecture.num_hidden_layers


def head_params(architecture) -> int:
    """The head trained in full: the pooler's h x h Linear and the classifier, weights and biases."""
    h = architecture.hidden_size
    return h * h + h + h * NUM_LABELS + NUM_LABELS


@pytest.mark.parametrize("rank", [8, 32])
def test_lora_trains_the_low_rank_updates_and_the_head(rank):
    model, cfg = adapted("adapter=lora", f"adapter.r={rank}")
    expected = sum(rank * (i + o) for i, o in linear_shapes(cfg.model.architecture))
    expected += head_params(cfg.model.architecture)
    total, trainable = parameter_counts(model)
    assert trainable == expected
    assert memory.params_footprint(model, trainable_only=True).bytes == 4 * expected
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in n or "modules_to_save" in n for n in trained)
    assert sum("classifier.modules_to_save" in n for n in trained) == 2  # the head's weight and bias
    assert sum("pooler.modules_to_save" in n for n in trained) == 2  # the pooler's, in full, no LoRA


def test_dora_adds_one_magnitude_per_output_of_each_targeted_layer():
    lora, cfg = adapted("adapter=lora")
    dora, _ = adapted("adapter=dora")
    outputs = sum(o for _, o in linear_shapes(cfg.model.architecture))
    assert parameter_counts(dora)[1] == parameter_counts(lora)[1] + outputs


def test_qlora_counts_4bit_weights_by_the_storages_bitsandbytes_holds():
    lora, cfg = adapted("adapter=lora")
    qlora, _ = adapted("adapter=qlora")
    shapes = linear_shapes(cfg.model.architecture)
    quantized = [i * o for i, o in shapes]
    # each layer: packed codes (2 per byte), one uint8 absmax per block, the 16-entry fp32 NF4 code,
    # an fp32 offset, the nested fp32 absmax (one per 256 blocks) and the nested 256-entry fp32 map
    held = sum(
        n // 2 + n // BLOCK + 16 * 4 + 4 + math.ceil(n / BLOCK / NESTED_BLOCK) * 4 + 256 * 4
        for n in quantized
    )
    lora_bytes = memory.params_footprint(lora).bytes
    assert memory.params_footprint(qlora).bytes == lora_bytes - 4 * sum(quantized) + held
    assert parameter_counts(qlora) == parameter_counts(lora)  # a 4-bit weight is still one parameter
    assert memory.params_footprint(qlora, trainable_only=True) == memory.params_footprint(
        lora, trainable_only=True
    )


@pytest.mark.parametrize(
    "extra, head",
    [([], ["bert.pooler.dense", "classifier"]), (["task=causal_lm", "model=llama_tiny"], ["lm_head"])],
)
def test_qlora_leaves_the_head_in_full_precision_and_the_replay_quantizes_the_same_layers(extra, head):
    import transformers
    from bitsandbytes.nn import Linear4bit

    from effitrain.train.adapters.replay import quantized_layers

    model, cfg, task = loaded("adapter=qlora", *extra)
    for name in head:
        layer = model.get_submodule(name)
        assert type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32, name
    in_4bit = [name for name, m in model.named_modules() if isinstance(m, Linear4bit)]
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(in_4bit) == sorted(set(linears) - set(head))
    if not extra:  # the tiny BERT: the 6 Linear layers of each block, counted from its config
        assert len(in_4bit) == len(linear_shapes(cfg.model.architecture))
    auto = getattr(transformers, task.auto_class)
    quantization = quantization_config(cfg.adapter, cfg.precision.mixed_precision)
    assert len(quantized_layers(auto, model.config, quantization)) == len(in_4bit)


@pytest.mark.parametrize(
    "precision, dtype", [("no", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_the_4bit_layers_compute_in_the_precision_of_the_run(precision, dtype):
    assert quantization_config(compose("adapter=qlora").adapter, precision).bnb_4bit_compute_dtype == dtype
    assert quantization_config(compose("adapter=lora").adapter, precision) is None
    assert quantization_config(compose().adapter, precision) is None


@pytest.mark.parametrize("optimizer_name", OPTIONS)
def test_the_optimizer_holds_state_for_the_adapter_alone_equal_to_its_estimate(optimizer_name):
    torch.manual_seed(0)
    model, _ = adapted("adapter=lora")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = build_optimizer(compose(f"optimizer={optimizer_name}").optimizer, model, weight_decay=0.01)
    trainable = memory.params_footprint(model, trainable_only=True)
    assert memory.footprint(memory.optimizer_params(optimizer)) == trainable
    estimated = memory.estimate_optimizer_state(optimizer)
    batch = {"input_ids": torch.randint(0, 1000, (2, 8)), "labels": torch.tensor([0, 2])}
    with memory.GradientRecorder(memory.optimizer_params(optimizer)) as grads:
        model(**batch).loss.backward()
    optimizer.step()
    assert memory.optimizer_state_footprint(optimizer) == estimated
    assert grads.footprint() == trainable  # gradients only where weights train
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name  # weight decay never reaches a frozen weight


@pytest.mark.slow
@pytest.mark.parametrize(
    "adapter, backend, extra",
    [
        ("lora", "accelerator", []),
        ("lora", "trainer", []),
        ("qlora", "accelerator", []),
        ("qlora", "trainer", []),
        ("dora", "accelerator", ["compile=on", "compile.backend=aot_eager", "optimizer=adam8bit"]),
        ("qlora", "accelerator", ["task=causal_lm", "model=llama_tiny", "max_length=32"]),
    ],
)
def test_a_run_trains_the_adapter_and_reports_its_parts(tmp_path, adapter, backend, extra):
    summary = run_job(tmp_path, f"adapter={adapter}", f"backend={backend}", "max_steps=3",
                      "gradient_accumulation_steps=2", "gradient_checkpointing=true", *extra)  # fmt: skip
    assert summary["status"] == "ok", summary.get("error")
    model, _ = adapted(f"adapter={adapter}", *extra)
    trainable = memory.params_footprint(model, trainable_only=True).bytes
    assert summary["params/trainable"] == parameter_counts(model)[1]
    assert summary["mem/params_bytes"] == memory.params_footprint(model).bytes
    assert summary["mem/params_trainable_bytes"] == summary["mem/grads_bytes"] == trainable
    assert summary["mem/optimizer_state_bytes"] == summary["mem/optimizer_state_bytes_estimated"]
    if "optimizer=adam8bit" not in extra:
        tensors = sum(p.requires_grad for p in model.parameters())
        assert summary["mem/optimizer_state_bytes"] == 2 * trainable + 4 * tensors  # AdamW: 2 moments, a step
    assert math.isfinite(summary["train/loss"])


def test_in_training_a_lora_layer_drops_its_input_at_lora_dropout():
    """Training mode: ``W x + b + (lora_alpha / r) B A dropout(x)``, the dropped input drawn here with
    the same seed at the configured ``adapter.lora_dropout`` (0.5: half the input zeroed, the rest
    doubled); the configured rate, not another, reproduces the layer's output."""
    model, _ = adapted("adapter=lora", "adapter.lora_dropout=0.5")
    model.train()
    layer = next(m for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    base, a, b = layer.base_layer, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    scale = layer.scaling["default"]
    with torch.no_grad():
        b.normal_()
        x = torch.randn(64, base.in_features)
        torch.manual_seed(7)
        output = layer(x)
        torch.manual_seed(7)
        dropped = torch.nn.functional.dropout(x, p=0.5, training=True)
        expected = (
            x @ base.weight.T + (base.bias if base.bias is not None else 0) + scale * (dropped @ a.T @ b.T)
        )
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
        undropped = x @ base.weight.T + (base.bias if base.bias is not None else 0) + scale * (x @ a.T @ b.T)
        assert not torch.allclose(output, undropped, rtol=1e-3, atol=1e-3)  # the rate matters


@pytest.mark.parametrize(("r", "alpha"), [(4, 16), (8, 8)])
def test_a_lora_layer_computes_w_x_plus_alpha_over_r_b_a_x(r, alpha):
    """A wrapped Linear's output against the formula, by hand: ``W x + b + (lora_alpha / r) B A x``
    (B made nonzero: it starts at zero, where any scale gives the same output). Dropout off (eval)."""
    model, _ = adapted("adapter=lora", f"adapter.r={r}", f"adapter.lora_alpha={alpha}")
    model.eval()
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert layers
    torch.manual_seed(0)
    for layer in layers[:3]:
        base, a, b = layer.base_layer, layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert (a.shape, b.shape) == ((r, base.in_features), (base.out_features, r))
        with torch.no_grad():
            b.normal_()
            x = torch.randn(5, base.in_features)
            expected = (
                x @ base.weight.T
                + (base.bias if base.bias is not None else 0)
                + (alpha / r) * (x @ a.T @ b.T)
            )
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
