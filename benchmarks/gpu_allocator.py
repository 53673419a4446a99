"""What the CUDA allocator adds to the replayed tensors, checked by switching each part off:

    python benchmarks/gpu_allocator.py            # on a CUDA machine (about 1 min on one H200)

Two cases of ``benchmarks/gpu.py`` (distilbert with Adafactor, whose many small state tensors round
the most; llama_small with AdamW), each run three ways in a process of its own:

* as is;
* ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: MemTracker then counts each CUDA storage at its own size
  instead of rounding it up to the caching allocator's 512-byte block, as the replay on CPU fake
  tensors counts it: the step peak measured should equal the predicted one to the byte;
* ``CUBLAS_WORKSPACE_CONFIG=:0:0``: cuBLAS without its workspace, which the caching allocator holds
  beside the tensors (one per cuBLAS handle: the step's thread and autograd's each have one):
  ``max_memory_allocated`` over the predicted run peak should fall by their size.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu import COMMON, MODELS  # noqa: E402

MIB = 2**20
CASES = {
    "distilbert_base_cased adafactor fp32": [*MODELS["distilbert_base_cased"], "optimizer=adafactor"],
    "llama_small adamw bf16": [*MODELS["llama_small"], "optimizer=adamw", "precision=bf16"],
}
SETTINGS = {
    "as is": {},
    "PYTORCH_NO_CUDA_MEMORY_CACHING=1": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
    "CUBLAS_WORKSPACE_CONFIG=:0:0": {"CUBLAS_WORKSPACE_CONFIG": ":0:0"},
}


def run(overrides: list[str], env: dict) -> dict:
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "effitrain.cli", "train", *overrides, *COMMON, "max_steps=4",
                   "logger=none", "progress_bar=false", f"hydra.run.dir={folder}"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, check=False)
        summary = Path(folder) / "summary.json"
        if not summary.exists():
            return {"status": f"failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"}
        return json.loads(summary.read_text())


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_allocator.py: no CUDA device here")
    jobs = [(case, setting) for case in CASES for setting in SETTINGS]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        summaries = list(pool.map(lambda job: run(CASES[job[0]], SETTINGS[job[1]]), jobs))
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(
        "| case | setting | step peak measured - predicted (bytes) | max allocated - run peak predicted (MiB) |"
    )
    print("|---|---|---:|---:|")
    for (case, setting), s in zip(jobs, summaries):
        if s.get("status") != "ok":
            print(f"| {case} | {setting} | {s.get('status')} | |")
            continue
        step = s["mem/step_peak_bytes"] - s["mem/step_peak_bytes_predicted"]
        run_excess = (s["mem/cuda_max_allocated_bytes"] - s["mem/run_peak_bytes_predicted"]) / MIB
        print(f"| {case} | {setting} | {step:,} | {run_excess:.1f} |")


if __name__ == "__main__":
    main()
