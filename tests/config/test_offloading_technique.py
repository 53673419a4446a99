"""The activation_offloading technique: its key, values, override, replay key and plan axis, and
what its hooks copy (a saved activation of the minimum size and more; never a parameter, a view
of one, a buffer or a smaller tensor), exactly and only where asked."""

from __future__ import annotations

import contextlib

import pytest
import torch

from effitrain.config.errors import ConfigError
from effitrain.config.techniques import ACTIVATION_OFFLOADING, TECHNIQUES, replay_keys
from effitrain.config.techniques.offload_hooks import Offloader, copies_forced, offloaded_forward
from tests.helpers.run import compose


def test_it_is_a_technique_with_its_key_default_off_and_its_override():
    assert ACTIVATION_OFFLOADING in TECHNIQUES and ACTIVATION_OFFLOADING.key == "activation_offloading"
    cfg = compose()
    assert cfg.activation_offloading is False and ACTIVATION_OFFLOADING.minimum(cfg) is None
    assert ACTIVATION_OFFLOADING.described(cfg) == "activation_offloading=false"
    assert ACTIVATION_OFFLOADING.minimum(compose("activation_offloading=true")) == 1024  # torchtune's default
    assert ACTIVATION_OFFLOADING.minimum(compose("activation_offloading=1")) == 1
    assert [ACTIVATION_OFFLOADING.override(v) for v in (False, True, 4096)] == [
        "activation_offloading=false",
        "activation_offloading=true",
        "activation_offloading=4096",
    ]


def test_its_replay_key_names_the_minimum_and_leaves_the_key_of_the_lever_off_as_it_was():
    assert "activation_offloading" not in replay_keys(compose())
    assert replay_keys(compose("activation_offloading=true"))["activation_offloading"] == 1024
    assert replay_keys(compose("activation_offloading=64"))["activation_offloading"] == 64


def test_its_plan_axis_is_off_first_the_users_own_alone_and_off_alone_on_a_cpu():
    cfg = compose()
    assert ACTIVATION_OFFLOADING.plan_values(cfg, False, None, "cuda") == [False, True]
    assert ACTIVATION_OFFLOADING.plan_values(cfg, False, (True, 4096), "cuda") == [False, True, 4096]
    assert ACTIVATION_OFFLOADING.plan_values(cfg, False, None, "cpu") == [False]  # saves nothing there
    assert ACTIVATION_OFFLOADING.plan_values(cfg, False) == [False]  # the protocol's default: cpu
    assert not ACTIVATION_OFFLOADING.recomputes(compose("activation_offloading=true"))
    assert ACTIVATION_OFFLOADING.plan_values(compose("activation_offloading=2048"), True) == [2048]


@pytest.mark.parametrize("value", [0, -1, 2.5, "yes"])
def test_its_check_is_one_line_naming_the_value(value):
    from omegaconf import OmegaConf

    # untyped, past the schema (whose own words for a wrong type are the technique's: bad_inputs.py)
    cfg = OmegaConf.create({"activation_offloading": value, "compile": {"enabled": False}})
    with pytest.raises(ConfigError) as error:
        ACTIVATION_OFFLOADING.check(cfg)
    shown = repr(value)
    assert str(error.value) == (
        f"activation_offloading={shown} is invalid: must be true, false or a minimum tensor size in bytes N >= 1"
    )


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16, 16), 0.5))

    def forward(self, x):
        return (torch.tanh(self.linear(x)) * self.scale).sum()


def _saved_sizes(minimum: int, forced: bool) -> tuple[list[int], torch.Tensor]:
    """The byte sizes the hooks copied in one forward of a 16-row batch, and the weight's gradient."""
    torch.manual_seed(0)
    model, copied = _Tiny(), []
    offloaded_forward(model, minimum)
    pack = Offloader.pack

    def counting(self, tensor):
        packed = pack(self, tensor)
        if packed is not tensor:
            copied.append(packed[0].nbytes)
            assert packed[0].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
        return packed

    Offloader.pack = counting
    try:
        with copies_forced() if forced else contextlib.nullcontext():
            model(torch.ones(16, 16)).backward()
    finally:
        Offloader.pack = pack
    return copied, model.linear.weight.grad


def test_the_hooks_copy_saved_activations_of_the_minimum_and_more_and_change_no_gradient():
    # saved for backward: the linear's input x (1,024 B: its weight's gradient needs it), tanh's output
    # (1,024 B) and the buffer the product scales by (1,024 B, a buffer: not copied); the weight's view
    # W.t() is not saved (x needs no gradient), the product's other factor neither (the buffer needs none)
    torch.manual_seed(0)
    plain = _Tiny()
    plain(torch.ones(16, 16)).backward()
    copied, grad = _saved_sizes(1024, forced=True)
    assert sorted(copied) == [1024, 1024] and torch.equal(grad, plain.linear.weight.grad)
    assert _saved_sizes(1025, forced=True)[0] == []  # below the minimum: kept
    assert _saved_sizes(1, forced=False)[0] == []  # the CPU's own tensors: the host is the device


def _copied_in_a_llama_step(checkpointing: str) -> tuple[list, list, list[bool]]:
    """What the hooks copied in one forward and backward of a 2-layer Llama (copies forced), each
    decoder layer's input, and for each copy whether it was made inside a layer's forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from effitrain.config.techniques import apply_techniques

    cfg = compose("task=causal_lm", "model=llama_tiny", f"gradient_checkpointing={checkpointing}",
                  "activation_offloading=true")  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    model.train()
    inputs, copied, within, inside, pack = [], [], [], [False], Offloader.pack

    def entered(module, args):
        inside[0] = True
        inputs.append(args[0])

    for layer in model.model.layers:
        layer.register_forward_pre_hook(entered)
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def recording(self, tensor):
        packed = pack(self, tensor)
        if packed is not tensor:
            copied.append(tensor)
            within.append(inside[0])
        return packed

    Offloader.pack = recording
    try:
        with copies_forced():
            apply_techniques(model, cfg)
            ids = torch.randint(0, 64, (2, 32))
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        Offloader.pack = pack
    return copied, inputs[: len(model.model.layers)], within  # a recomputed layer runs its pre-hook again


def test_with_checkpointing_the_blocks_inputs_are_what_is_copied_of_them():
    def of_a_block(copied, inputs, within):  # copied in a block's call, and not its input
        return [t for t, flag in zip(copied, within) if flag and not any(t is x for x in inputs)]

    assert of_a_block(*_copied_in_a_llama_step("false"))  # without checkpointing the blocks' own are copied
    copied, inputs, within = _copied_in_a_llama_step("true")
    # with it, each block's input is (torch's checkpoint saves it outside the block's own hooks),
    # and nothing the blocks compute inside: all of that is recomputed in backward
    assert len(inputs) == 2 and all(any(t is x for t in copied) for x in inputs)
    assert of_a_block(copied, inputs, within) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies on a side stream need a CUDA device")
def test_on_cuda_the_host_copies_are_pinned_and_the_gradients_unchanged():
    def gradients(offloading: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)
        ).cuda()
        if offloading:
            offloaded_forward(model, 1024)
        x = torch.randn(64, 256, device="cuda")
        for _ in range(3):  # the side stream's copies and the allocator's reuse across steps
            model(x).square().mean().backward()
        torch.cuda.synchronize()
        return [p.grad.clone() for p in model.parameters()]

    hosts, pack = [], Offloader.pack

    def recording(self, tensor):
        packed = pack(self, tensor)
        if packed is not tensor:
            hosts.append(packed[0])
        return packed

    Offloader.pack = recording
    try:
        offloaded = gradients(True)
    finally:
        Offloader.pack = pack
    assert hosts and all(h.device.type == "cpu" and h.is_pinned() for h in hosts)
    assert all(torch.equal(a, b) for a, b in zip(offloaded, gradients(False)))
