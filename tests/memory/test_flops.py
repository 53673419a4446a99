"""The device peaks MFU divides by, against the vendors' published figures written here (not read
from effitrain's table), and the CPU's measured peak from a timing the test controls."""

from __future__ import annotations

import pytest
import torch

from effitrain.memory import flops

# NVIDIA H100 SXM5 data sheet: FP32 67 TFLOPS (no tensor cores); BF16 tensor core 1,979 TFLOPS with
# 2:4 sparsity, so 989.5 dense
H100_FP32 = 67e12
H100_BF16_DENSE = 1979e12 / 2


@pytest.mark.parametrize("precision, peak", [("no", H100_FP32), ("bf16", H100_BF16_DENSE)])
def test_mfu_divides_by_the_h100_peak_of_the_run_s_precision(monkeypatch, precision, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    keys = flops.mfu_keys(flops_per_step=6e12, step_s=0.5, device="cuda", mixed_precision=precision)
    assert keys["speed/achieved_flops_per_s"] == 12e12
    assert keys["speed/mfu"] == pytest.approx(12e12 / peak, rel=1e-3)


# NVIDIA H100 PCIe and NVL data sheets: BF16 tensor core 1,513 and 1,671 TFLOPS with sparsity; FP32 51
# and 60 TFLOPS: a PCIe card divided by the SXM board's peak would under-report its MFU by a quarter
@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 PCIe", 1513e12 / 2),
        ("NVIDIA H100 NVL", 1671e12 / 2),
        ("NVIDIA H100 80GB HBM3", H100_BF16_DENSE),
    ],
)
def test_each_h100_board_has_its_own_peak(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert flops.device_peak(torch.device("cuda"), "bf16")[0] == pytest.approx(peak, rel=1e-3)


def test_the_cpu_peak_is_two_flops_per_multiply_add_of_the_timed_matmul(monkeypatch, tmp_path):
    """A 1024 x 1024 by 1024 x 1024 product is 1024^3 multiply-adds; timed (here) at 0.25 s."""
    monkeypatch.setattr(flops, "_timed", lambda fn: 0.25)
    peak, source = flops.device_peak(torch.device("cpu"), "no", cache_dir=str(tmp_path))
    assert peak == 2 * 1024**3 / 0.25 and source == "this CPU's float32 matmul, measured"
    # cached per machine: read back, not timed again
    monkeypatch.setattr(flops, "_timed", lambda fn: 1.0)
    assert flops.device_peak(torch.device("cpu"), "no", cache_dir=str(tmp_path))[0] == peak


def test_an_unknown_peak_gives_no_mfu_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Tesla V100-SXM2-16GB")
    # the V100 has no bf16: no figure rather than another precision's
    assert flops.device_peak(torch.device("cuda"), "bf16") == (
        None, "no peak known for NVIDIA Tesla V100-SXM2-16GB (bf16): add it to effitrain.memory.flops.GPU_PEAKS"
    )  # fmt: skip
    assert flops.device_peak(torch.device("cuda"), "fp16") == (125e12, "V100 fp16 data-sheet peak")
    keys = flops.mfu_keys(flops_per_step=6e12, step_s=0.5, device="cuda", mixed_precision="bf16")
    assert keys["speed/mfu"] is None and keys["speed/mfu_note"].startswith("no peak known for NVIDIA")
    assert flops.device_peak(torch.device("meta"), "no") == (None, "no peak known for device type meta")
    for step_flops, step_s in ((None, 0.5), (6e12, None), (0, 0.5)):
        assert flops.mfu_keys(step_flops, step_s, "cpu", "no") == {
            "speed/mfu": None, "speed/mfu_note": "no FLOP count or step time"
        }  # fmt: skip
