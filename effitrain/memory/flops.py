"""Model FLOPs utilization, as nanoGPT reports it: the FLOPs one optimizer step needs (counted once,
by ``torch.utils.flop_counter.FlopCounterMode`` on the fake-tensor replay of the tracked step) over
the step's median time, against the device's peak.

The peak comes from a small table of accelerators' dense tensor-core figures (by name and
precision); on a CPU from a short float32 matmul measured once per machine and cached. Where
neither is known, ``speed/mfu`` is null and ``speed/mfu_note`` says why.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

# Dense peak FLOP/s by device name fragment and precision (vendors' data sheets, without sparsity);
# fp32 on NVIDIA is the TF32 tensor-core figure torch uses for matmuls when allowed, else the FMA one.
GPU_PEAKS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    # the H100's PCIe and NVL boards run slower clocks than the SXM board that "H100" alone names;
    # matched first (the first fragment found in the device's name is taken)
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A10G": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12},
}
PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _cpu_peak(cache: Path) -> float:
    """float32 matmul FLOP/s of this CPU (best of a few 1024^3 products), cached per machine."""
    key = f"{os.uname().nodename}-{os.cpu_count()}-{torch.get_num_threads()}-{torch.__version__}"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return float(cached["flops_per_s"])
    except (OSError, ValueError, KeyError):
        pass
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)  # warm-up
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
    flops = 2 * 1024**3 / best
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "flops_per_s": flops}))
    except OSError:
        pass
    return flops


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def device_peak(
    device: torch.device, mixed_precision: str, cache_dir: str | None = None
) -> tuple[float | None, str]:
    """(peak FLOP/s or None, where it came from)."""
    precision = PRECISION.get(mixed_precision, "fp32")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peaks in GPU_PEAKS.items():
            if fragment in name and precision in peaks:
                return peaks[precision], f"{fragment} {precision} data-sheet peak"
        return None, f"no peak known for {name} ({precision}): add it to effitrain.memory.flops.GPU_PEAKS"
    if device.type == "cpu":
        folder = Path(cache_dir or "~/.cache/effitrain").expanduser()
        return _cpu_peak(folder / "cpu_matmul_peak.json"), "this CPU's float32 matmul, measured"
    return None, f"no peak known for device type {device.type}"


def mfu_keys(flops_per_step: int | None, step_s: float | None, device, mixed_precision: str) -> dict:
    if not flops_per_step or not step_s:
        return {"speed/mfu": None, "speed/mfu_note": "no FLOP count or step time"}
    achieved = flops_per_step / step_s
    peak, source = device_peak(torch.device(device), mixed_precision)
    return {
        "speed/achieved_flops_per_s": achieved,
        "speed/mfu": achieved / peak if peak else None,
        "speed/mfu_note": source,
    }
