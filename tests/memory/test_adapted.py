"""The step peak of an adapted model (adapter=lora, dora) replayed on fake tensors is the step a real
CPU run measured, category by category, to the byte."""

from __future__ import annotations

import pytest
import transformers
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn import Parameter

from effitrain.commands.estimate import estimate_memory
from effitrain.config.summary_schema import CATEGORIES
from effitrain.train.adapters.replay import BOUND_DEQUANTIZED, adapted_on_meta, faked
from effitrain.train.modeling import build_model
from effitrain.train.tasks import build_task
from effitrain.util.compat import fake_tensor_mode
from tests.helpers.run import compose, run_job
from tests.memory.test_memory import assert_predicted_is_measured

CAUSAL = ["task=causal_lm", "model=llama_tiny"]
CHECKPOINTED_WINDOW = ["gradient_checkpointing=true", "gradient_accumulation_steps=2"]


def _case(adapter, overrides, case_id):
    return pytest.param(adapter, overrides, id=case_id, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "adapter, overrides",
    [
        _case("lora", [], "lora-tiny"),
        _case("dora", [], "dora-tiny"),
        _case("lora", CAUSAL, "lora-llama"),
        _case("dora", CAUSAL, "dora-llama"),
        _case("lora", CHECKPOINTED_WINDOW, "lora-tiny-checkpointed-accumulated"),
        _case("dora", [*CAUSAL, *CHECKPOINTED_WINDOW], "dora-llama-checkpointed-accumulated"),
    ],
)
def test_the_predicted_step_peak_of_an_adapter_is_the_measured_one(tmp_path, adapter, overrides):
    """The frozen base, the adapters and the head, their gradients, state, activations and
    temporaries; with DoRA the graph of B @ A its forward leaves unused too, freed at once."""
    summary = run_job(tmp_path, f"adapter={adapter}", "max_steps=3", *overrides)
    assert summary["status"] == "ok", summary["error"]
    assert_predicted_is_measured(summary)
    assert summary["mem/step_peak/gradients_bytes"] < summary["mem/step_peak/weights_bytes"] / 10


@pytest.mark.parametrize("adapter", ["lora", "dora"])
def test_a_faked_model_is_the_meta_model_in_fake_tensors(adapter):
    """Every parameter and buffer keeps its shape, dtype and requires_grad; none holds memory."""
    cfg = compose(f"adapter={adapter}", *CAUSAL, "+model.architecture.tie_word_embeddings=true")
    task = build_task(cfg)
    config = build_model(cfg.model, None, device="meta", auto_class=task.auto_class).config
    auto = getattr(transformers, task.auto_class)
    meta = adapted_on_meta(auto, config, cfg, task)
    expected = [
        (n, p.shape, p.dtype, p.requires_grad) for n, p in meta.named_parameters(remove_duplicate=False)
    ]
    buffers = [(n, b.shape, b.dtype) for n, b in meta.named_buffers()]
    with fake_tensor_mode():
        model = faked(adapted_on_meta(auto, config, cfg, task))
    params = list(model.named_parameters(remove_duplicate=False))
    assert [(n, p.shape, p.dtype, p.requires_grad) for n, p in params] == expected
    assert [(n, b.shape, b.dtype) for n, b in model.named_buffers()] == buffers
    assert all(
        isinstance(p, Parameter) and isinstance(p, FakeTensor) and p.device.type == "cpu" for _, p in params
    )
    # the input embedding and the output projection are one tensor, in meta and fake alike
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    trainable = sum(p.numel() for _, p in params if p.requires_grad)
    assert 0 < trainable == sum(p.numel() for p in meta.parameters() if p.requires_grad)
    assert trainable < sum(p.numel() for p in meta.parameters()) / 10


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, dequantized",
    [
        (["precision=fp32"], 64 * 32 * 4 + 32 * 4),
        (["precision=bf16"], 64 * 32 * (4 + 2) + 32 * 4),  # then cast to the bf16 compute dtype
        (
            ["precision=bf16", "task=causal_lm", "model=llama_tiny", "max_length=64"],
            64 * 32 * (4 + 2) + 32 * 4,
        ),
    ],
    ids=["fp32", "bf16", "bf16-causal"],
)
def test_qlora_is_predicted_to_the_byte_but_one_dequantized_layer_above(tmp_path, overrides, dequantized):
    """QLoRA's 4-bit layers are traced at full precision with bitsandbytes' dtype flow
    (``Linear4bit.forward``: under bf16 each output cast back to fp32, what the next ops save then
    fp32, and no bf16 copy of the weight kept) and their weights counted: the packed codes, the
    biases bitsandbytes casts to the compute dtype in place, to the byte. The largest quantized
    layer dequantized (the tiny models' 64 x 32 intermediate weights in fp32, cast to bf16 under
    bf16, and 32 fp32 absmax of its blocks of 64) is added as a temporary throughout: bitsandbytes
    holds it inside its matmul, which on this step is not at the peak. Before the dtype flow was
    replayed the bf16 causal run's activations were 51,200 B above the prediction."""
    summary = run_job(tmp_path, "adapter=qlora", "max_steps=2", *overrides)
    assert summary["status"] == "ok", summary["error"]
    measured = {c: summary[f"mem/step_peak/{c}_bytes"] for c in CATEGORIES}
    predicted = {c: summary[f"mem/step_peak_predicted/{c}_bytes"] for c in CATEGORIES}
    assert predicted.pop("temporaries") - measured.pop("temporaries") == dequantized
    assert predicted == measured
    assert summary["mem/step_peak_predicted_bound"] == BOUND_DEQUANTIZED


@pytest.mark.slow
def test_the_replayed_4bit_layers_save_what_bitsandbytes_saves():
    """One forward of the tiny Llama under bf16 autocast: the tensors autograd saves for backward (by
    shape and dtype, parameters left out) with bitsandbytes' real 4-bit layers (QLoRA on this CPU)
    and with the replay's stand-in (:func:`as_4bit_layers` on the full-precision LoRA model) are the
    same; plain LoRA's differ (bf16 copies of the frozen weights, bf16 layer outputs)."""
    import collections

    import torch

    from effitrain.train.adapters.configs import quantization_config
    from effitrain.train.adapters.replay import _auto, as_4bit_layers, quantized_names
    from tests.train.test_adapters import adapted

    overrides = ["task=causal_lm", "model=llama_tiny", "max_length=64", "precision=bf16"]

    def saved(model):
        held = {}
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(tensor):
            held[tensor.untyped_storage().data_ptr()] = (tuple(tensor.shape), tensor.dtype)
            return tensor

        ids = torch.randint(0, 100, (2, 64))
        model.train()
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", torch.bfloat16),
        ):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        return collections.Counter(v for k, v in held.items() if k not in params)

    qlora, cfg = adapted("adapter=qlora", *overrides)
    lora, _ = adapted("adapter=lora", *overrides)
    plain = saved(lora)
    quantization = quantization_config(cfg.adapter, "bf16")
    as_4bit_layers(lora, quantized_names(_auto(cfg), lora.config, quantization), torch.bfloat16)
    assert saved(lora) == saved(qlora) != plain


def test_the_cuda_profile_applies_to_adapters():
    """``estimate adapter=lora --device cuda`` replays CUDA's kernels on the adapted model: its
    weights and AdamW's moments are the CPU's with each storage in the allocator's 512-byte blocks
    (the step counts stay on the CPU, at their size), counted here storage by storage on the adapted
    model; activations differ too, where CUDA's attention kernel saves its log-sum-exp instead of the
    attention probabilities."""
    from effitrain.memory.cuda import in_blocks

    cfg = compose("adapter=lora", "max_length=64")
    cpu = estimate_memory(cfg)["chosen"]["step_peak"]
    cuda = estimate_memory(cfg, device="cuda")["chosen"]["step_peak"]
    task = build_task(cfg)
    config = build_model(cfg.model, 3, None, device="meta", auto_class=task.auto_class).config
    model = adapted_on_meta(getattr(transformers, task.auto_class), config, cfg, task)
    blocks = sum(in_blocks(t.nbytes) - t.nbytes for t in model.parameters())  # no weight tied here
    blocks += sum(in_blocks(t.nbytes) - t.nbytes for t in model.buffers())
    trained = sum(in_blocks(p.nbytes) - p.nbytes for p in model.parameters() if p.requires_grad)
    assert blocks > 0 and trained > 0
    assert cuda["weights_bytes"] - cpu["weights_bytes"] == blocks
    assert cuda["optimizer_state_bytes"] - cpu["optimizer_state_bytes"] == 2 * trained
    assert (
        cuda["gradients_bytes"] == cpu["gradients_bytes"]
        and cuda["temporaries_bytes"] == cpu["temporaries_bytes"]
    )
    assert cuda["activations_bytes"] < cpu["activations_bytes"]


def test_qlora_s_count_is_said_a_bound_on_both_devices():
    """The 4-bit base's dequantized layer is counted as a temporary throughout: an upper bound, said
    on the CPU (pinned above) and on CUDA (both H200 QLoRA rows, tests/memory/test_cuda.py)."""
    cfg = compose("adapter=qlora", "max_length=64")
    bounds = {
        device: estimate_memory(cfg, device=device)["chosen"]["step_peak_bound"] for device in ("cpu", "cuda")
    }
    assert bounds == {"cpu": BOUND_DEQUANTIZED, "cuda": BOUND_DEQUANTIZED}


def test_dora_s_replay_holds_a_magnitude_per_output_of_each_wrapped_layer():
    """DoRA against LoRA on the tiny BERT, in the replay's weights at the step peak: one fp32
    magnitude per output of every wrapped Linear (all-linear, the head trained in full): per block
    query, key, value and attention output (32 each), intermediate (64) and output (32), 2 blocks."""
    base = ["model=tiny", "max_length=16", "micro_batch_size=2", "eval_batch_size=1"]
    [lora] = estimate_memory(compose(*base, "adapter=lora")).values()
    [dora] = estimate_memory(compose(*base, "adapter=dora")).values()
    magnitudes = 2 * (4 * 32 + 64 + 32)
    assert dora["step_peak"]["weights_bytes"] - lora["step_peak"]["weights_bytes"] == 4 * magnitudes
    assert dora["params_trainable"] - lora["params_trainable"] == magnitudes


def test_qlora_s_count_is_what_bitsandbytes_itself_packs_for_each_layer():
    """The 4-bit count against bitsandbytes' own quantization (``quantize_4bit`` on this CPU) of a
    tensor of each quantized layer's size: its packed bytes replace the fp32 weight, and the largest
    layer dequantized (fp32 compute: no cast) with the absmax values bitsandbytes makes for it
    (one per block of its default size) is the temporary added."""
    import bitsandbytes.functional as bnb
    import torch

    from effitrain.train.adapters.configs import quantization_config
    from effitrain.train.adapters.replay import counted_4bit, quantized_layers
    from effitrain.train.modeling import model_config

    cfg = compose("model=tiny", "adapter=qlora")
    task = build_task(cfg)
    config = model_config(cfg.model, 3, None, task.auto_class)
    layers = quantized_layers(
        getattr(transformers, task.auto_class), config, quantization_config(cfg.adapter, "no")
    )
    packed = {}
    for weight in layers:
        codes, state = bnb.quantize_4bit(torch.randn(weight.shape), quant_type="nf4")
        packed[weight.numel()] = (codes.numel() * codes.element_size(), state.absmax.numel())
    zero = dict.fromkeys([*CATEGORIES, "total"], 0)
    phases = {"later_step": dict(zero)}
    counted_4bit(phases, config, cfg)
    largest = max(w.numel() for w in layers)
    assert phases["later_step"]["weights"] == -sum(4 * w.numel() - packed[w.numel()][0] for w in layers)
    assert phases["later_step"]["temporaries"] == 4 * largest + 4 * packed[largest][1]


def test_under_bf16_the_4bit_layers_biases_are_counted_in_bf16_and_the_dequantized_copy_cast():
    """``Linear4bit.forward`` casts its bias to the compute dtype in place at its first call
    (``bias.data = bias.data.to(x.dtype)``): under bf16 each quantized layer's fp32 bias holds 2
    bytes an element fewer, on the tiny BERT (per block query, key, value and attention output of
    32 outputs, intermediate 64, output 32; 2 blocks), beside the packed codes (half a byte a
    weight); the dequantized temporary gains its bf16 cast (2 bytes a weight of the largest layer)."""
    from effitrain.train.adapters.replay import counted_4bit
    from effitrain.train.modeling import model_config

    cfg = compose("model=tiny", "adapter=qlora", "precision=bf16")
    task = build_task(cfg)
    config = model_config(cfg.model, 3, None, task.auto_class)
    h, i, blocks = 32, 64, 2
    weights = blocks * (4 * h * h + 2 * h * i)
    biases = blocks * (4 * h + i + h)
    zero = dict.fromkeys([*CATEGORIES, "total"], 0)
    phases = {"later_step": dict(zero)}
    counted_4bit(phases, config, cfg)
    assert phases["later_step"]["weights"] == -(weights * 4 - weights // 2) - 2 * biases
    largest = h * i
    assert phases["later_step"]["temporaries"] == largest * (4 + 2) + 4 * (largest // 64)
