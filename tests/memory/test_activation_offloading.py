"""Activation offloading (``activation_offloading``): exact copies, so bit-identical losses and weights
to the lever off, with and without gradient checkpointing (on the CPU with the copies forced, as a
GPU makes them); a CPU run's lever a no-op that says so, its memory equal to the lever off and
predicted to the byte; the CUDA profile's device activations below the lever off and its host
figure equal to the saved tensors' own bytes counted by a plain hook."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from effitrain.config.summary_schema import CATEGORIES
from effitrain.config.techniques.offload_hooks import copies_forced
from tests.helpers.run import compose, final_weights, read_metrics, run_job

MODELS = {
    "classifier": [],
    "causal": ["task=causal_lm", "model=llama_tiny", "max_length=64"],
}
COMMON = ["micro_batch_size=16", "data.num_train=64", "max_steps=3", "checkpoint_every=3"]
HOST = "host_offloaded"


def _trained_weights(run_dir: Path) -> dict:
    """The last checkpoint's trained weights: an adapter's own file, else the whole model's."""
    from safetensors.torch import load_file

    adapter = sorted(Path(run_dir).glob("checkpoints/step-*"))[-1] / "adapter_model.safetensors"
    return load_file(adapter) if adapter.exists() else final_weights(run_dir)


def _figures(summary: dict, kind: str = "") -> dict:
    """The step peak's categories and host figure, measured (``kind=""``) or predicted."""
    return {c: summary[f"mem/step_peak{kind}/{c}_bytes"] for c in (*CATEGORIES, HOST)}


@pytest.mark.parametrize(
    ("kind", "checkpointing", "more"),
    [
        ("classifier", "false", []),
        pytest.param("causal", "false", [], marks=pytest.mark.slow),
        pytest.param("classifier", "true", [], marks=pytest.mark.slow),
        pytest.param("causal", "true", [], marks=pytest.mark.slow),
        # peft wraps the model after the hooks are set, accelerate or the Trainer prepares it after that
        pytest.param("causal", "false", ["adapter=lora"], marks=pytest.mark.slow),
        pytest.param("classifier", "false", ["backend=trainer"], marks=pytest.mark.slow),
    ],
)
def test_forced_copies_change_no_bit_and_the_host_copies_are_predicted_to_the_byte(tmp_path, kind, checkpointing,
                                                                                   more):  # fmt: skip
    args = [*COMMON, *MODELS[kind], f"gradient_checkpointing={checkpointing}", *more]
    off = run_job(tmp_path / "off", *args)
    with copies_forced():  # the CPU's saved tensors copied to the host and back, as a GPU's are
        on = run_job(tmp_path / "on", *args, "activation_offloading=true")
    assert off["status"] == on["status"] == "ok", (off.get("error"), on.get("error"))
    losses = [line["train/loss"] for line in read_metrics(tmp_path / "off")]
    assert len(losses) == 3 and [line["train/loss"] for line in read_metrics(tmp_path / "on")] == losses
    assert on["eval/loss"] == off["eval/loss"]
    a, b = _trained_weights(tmp_path / "off"), _trained_weights(tmp_path / "on")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the copies were made (the host holds them), and measured == predicted, host included
    assert on[f"mem/step_peak/{HOST}_bytes"] > 0 and off[f"mem/step_peak/{HOST}_bytes"] == 0
    assert on[f"mem/step_peak/{HOST}_bytes"] == on[f"mem/step_peak_predicted/{HOST}_bytes"]
    gap = {c: on[f"mem/step_peak/{c}_bytes"] - on[f"mem/step_peak_predicted/{c}_bytes"] for c in CATEGORIES}
    assert gap == {
        c: off[f"mem/step_peak/{c}_bytes"] - off[f"mem/step_peak_predicted/{c}_bytes"] for c in CATEGORIES
    }
    if (
        "backend=trainer" not in more
    ):  # the Trainer's step holds a 4-byte scalar the replay lacks, lever or not
        assert not any(gap.values())


@pytest.mark.parametrize("kind", ["classifier", pytest.param("causal", marks=pytest.mark.slow)])
def test_on_a_cpu_run_it_is_a_no_op_that_says_so_its_memory_the_lever_offs(tmp_path, kind, capsys):
    args = [*COMMON, *MODELS[kind]]
    off = run_job(tmp_path / "off", *args)
    capsys.readouterr()
    on = run_job(tmp_path / "on", *args, "activation_offloading=2048")
    said = [line for line in capsys.readouterr().out.splitlines() if "activation_offloading" in line]
    assert said == [
        "effitrain: activation_offloading=2048 is a no-op on this CPU run: the host is the device, "
        "nothing is offloaded (memory as with it off)"
    ]
    assert off["status"] == on["status"] == "ok"
    assert _figures(on) == _figures(on, "_predicted") == _figures(off) == _figures(off, "_predicted")
    assert on[f"mem/step_peak/{HOST}_bytes"] == 0
    assert [line["train/loss"] for line in read_metrics(tmp_path / "on")] == [
        line["train/loss"] for line in read_metrics(tmp_path / "off")
    ]


def _saved_bytes_counted_by_a_plain_hook(cfg, minimum: int) -> int:
    """The bytes of what the CUDA replay's forward saves for backward, of ``minimum`` bytes or more
    and neither a parameter (nor a view of one) nor a buffer, summed by a bare saved_tensors_hooks
    around the model's forward (the lever off): what offloading must put on the host."""
    from effitrain.commands.estimate import meta_model, replay_shapes
    from effitrain.memory.replay import replayed

    model = meta_model(cfg)
    batches, evaluation = replay_shapes(cfg, model)
    seen = []

    def pack(tensor):
        base = tensor if tensor._base is None else tensor._base
        own = isinstance(base, torch.nn.Parameter) or any(base is b for b in replay.model.buffers())
        if not own and tensor.numel() * tensor.element_size() >= minimum:
            seen.append(tensor.numel() * tensor.element_size())
        return tensor

    with replayed(model.config, cfg, batches, "cuda", evaluation) as replay:
        forward = replay.model.forward

        def recorded(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                return forward(*args, **kwargs)

        replay.model.forward = recorded
        replay.step(torch.optim.SGD(replay.model.parameters(), lr=1e-3))
    return sum(seen)


@pytest.mark.parametrize("checkpointing", ["false", pytest.param("true", marks=pytest.mark.slow)])
def test_the_cuda_profile_moves_the_saved_activations_from_the_device_to_the_host_figure(checkpointing):
    """With checkpointing the blocks' inputs are what the plain hook sees of them (torch's checkpoint
    saves them outside the blocks' own hooks), and what is offloaded."""
    from effitrain.commands.estimate import estimate_memory

    causal = [*MODELS["causal"], "micro_batch_size=4", f"gradient_checkpointing={checkpointing}"]
    rows = {}
    for value in ("false", "true"):
        cfg = compose(*causal, f"activation_offloading={value}")
        [rows[value]] = estimate_memory(cfg, {"adamw": cfg.optimizer}, device="cuda", cache=False).values()
    off, on = rows["false"], rows["true"]
    assert on["step_peak"]["activations_bytes"] < off["step_peak"]["activations_bytes"]
    assert off["step_peak_host_offloaded_bytes"] == 0
    counted = _saved_bytes_counted_by_a_plain_hook(compose(*causal), 1024)
    assert counted > 0 and on["step_peak_host_offloaded_bytes"] == counted
    for category in ("weights", "gradients", "optimizer_state"):  # what is not an activation stays
        assert on["step_peak"][f"{category}_bytes"] == off["step_peak"][f"{category}_bytes"]
