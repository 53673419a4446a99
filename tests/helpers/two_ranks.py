"""Two processes in one gloo group, started by ``torch.multiprocessing`` rather than torchrun, for
the fast checks of what crosses processes (tests/train/test_distributed.py):

* one optimizer step of a float64 linear classifier under DDP, through the accelerate backend's own
  ``step_ops`` and the shared ``window_step``, rank r on its own rows of :func:`rows` (its window:
  the micro-batches of ``WINDOWS[r]`` rows); rank r saves its weights after the step and the
  step's gradient norm to ``OUT/ddp<r>.pt``;
* ``write_rank_figures`` with figures that differ by rank (:func:`figures`), into ``OUT``.

Never forked from the test's process (a forked child of a process whose torch started its OpenMP
pool can wait on it forever): forked from a forkserver, a fresh interpreter that imports what the
ranks need once (``PRELOAD``: torch, accelerate, the two effitrain modules checked, and what DDP and
accelerate's ``prepare`` import on first use), where two spawned ranks would each import it, twice
the CPU time on a machine whose cores the other tests share. :func:`worker` is importable at module
level, as both need. The group meets through a file, not a port, so parallel sessions never collide.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

WORLD = 2
FEATURES, CLASSES = 3, 4
WINDOWS = ((3, 2), (1, 2))  # each rank's micro-batch sizes: unequal, so the step's items are not 2 x a rank's
LR = 0.5


def rows() -> tuple[torch.Tensor, torch.Tensor]:
    """The step's rows over both ranks, rank 0's first: inputs (float64) and class labels."""
    generator = torch.Generator().manual_seed(1)
    count = sum(map(sum, WINDOWS))
    x = torch.randn(count, FEATURES, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (count,), generator=generator)


def model() -> torch.nn.Linear:
    """The classifier every process starts from."""
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, CLASSES, dtype=torch.float64)


def figures(rank: int) -> dict:
    """What rank ``rank`` hands ``write_rank_figures``: its own memory figure, and a key that is
    not one (``eval/loss``), which the file must leave out."""
    return {"mem/step_peak_bytes": 1000 + rank, "eval/loss": 0.25 + rank}


class Task:
    """The task interface ``window_step`` and ``step_items`` use: summed cross-entropy, one item per row."""

    def loss_sum(self, model, batch):
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"], reduction="sum")

    def num_items(self, batch):
        return len(batch["labels"])


class _Meter:
    def add(self, loss, batch):
        pass


def worker(rank: int, out: str) -> None:
    """Rank ``rank``'s part. It leaves by ``os._exit``, freeing nothing: the DDP model's reducer holds
    the gloo group, and freeing it joins gloo's thread while holding the GIL that thread may be
    waiting for (a hang seen here). A failure is printed to stderr (the test shows it) and exits 1."""
    try:
        _step_and_figures(rank, Path(out))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _step_and_figures(rank: int, out: Path) -> None:
    from accelerate import Accelerator

    from effitrain.backends.accelerator import step_ops
    from effitrain.run.rank_figures import write_rank_figures
    from effitrain.train.step import step_items, window_step

    torch.set_num_threads(1)
    # what torchrun sets: accelerate reads them to join the group as one of WORLD CPU processes
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD)
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{out / 'store'}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == WORLD
    plain = model()
    ddp_model, optimizer = accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=LR))
    assert isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel)
    x, labels = rows()
    start = sum(map(sum, WINDOWS[:rank]))
    window = []
    for size in WINDOWS[rank]:
        window.append({"x": x[start : start + size], "labels": labels[start : start + size]})
        start += size
    task = Task()
    items = step_items(task, window, torch.device("cpu"))
    ops = step_ops(accelerator, ddp_model, None)
    norm = window_step(task, ddp_model, optimizer, window, items, _Meter(), ops)
    weights = {name: value.detach().clone() for name, value in plain.state_dict().items()}
    torch.save({"weights": weights, "grad_norm": float(norm)}, out / f"ddp{rank}.pt")
    write_rank_figures(out, figures(rank), rank)


PRELOAD = [
    "__main__", __name__, "accelerate", "effitrain.backends.accelerator", "effitrain.run.rank_figures",
    "torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
]  # fmt: skip


def run(out: Path, timeout_s: float = 120) -> None:
    """Both ranks, to the end; a rank's failure is raised here, as is a rank still running after
    ``timeout_s`` (killed then). The forkserver starts with the first call (its imports, about 2 s)
    and serves the test process's later ones."""
    torch.multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    ranks = torch.multiprocessing.start_processes(
        worker, args=(str(out),), nprocs=WORLD, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=max(deadline - time.monotonic(), 0)):  # raises a rank's failure
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
            raise TimeoutError(f"the two ranks were still running after {timeout_s} s")
