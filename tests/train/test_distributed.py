"""Data parallel on CPU: ``torchrun --nproc_per_node 2`` with accumulation k equals one process with 2k.

The fast checks share one pair of processes in a gloo group (tests/helpers/two_ranks.py, about
2.5 s): their DDP step equals one big batch's, counted here in closed form, and
``summary_ranks.json`` lists each rank's own figures; the slow ones run train.py under torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from effitrain.run.rank_figures import RANKS
from tests.helpers import two_ranks
from tests.helpers.run import REPO, TINY, read_metrics, relative_difference, train_py

# 64 samples in micro-batches of 4: 16 micro-batches, shared evenly by two processes.
DDP = [*TINY, "data.num_train=64", "data.num_eval=24", "micro_batch_size=4", "epochs=2",
       "+model.config_overrides.hidden_dropout_prob=0.0",
       "+model.config_overrides.attention_probs_dropout_prob=0.0"]  # fmt: skip


def torchrun(*args: str, cwd) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [*command, str(REPO / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The folder both spawned ranks wrote to (tests/helpers/two_ranks.py)."""
    out = tmp_path_factory.mktemp("two-ranks")
    two_ranks.run(out)
    return out


def test_two_processes_step_as_one_process_on_both_batches(spawned):
    """One SGD step of two DDP processes (the accelerate backend's ``step_ops``, ``window_step``) equals
    one step on all their rows with the mean loss, its gradient counted here in closed form: for
    cross-entropy over N rows, (softmax(x W^T + b) - onehot(y)) / N times x for W, summed for b.
    float64 on both sides, so summation order alone separates them: each of the at most 8 terms of a
    sum is under 10 in size, 8 x 10 x 2.2e-16 < 2e-14, hence atol 1e-12. A step whose gradient DDP
    averaged over the processes but that was not multiplied by them would be half this one's, off by
    LR x |g| / 2, far above it."""
    x, labels = two_ranks.rows()
    start = two_ranks.model()
    weight, bias = start.weight.detach(), start.bias.detach()
    # rows and the classifier small enough for the bound above
    assert x.abs().max() < 10 and weight.abs().max() < 1 and bias.abs().max() < 1
    error = (
        torch.softmax(x @ weight.T + bias, dim=1) - torch.nn.functional.one_hot(labels, two_ranks.CLASSES)
    ) / len(x)
    grads = {"weight": error.T @ x, "bias": error.sum(0)}
    expected = {
        "weight": weight - two_ranks.LR * grads["weight"],
        "bias": bias - two_ranks.LR * grads["bias"],
    }
    norm = torch.cat([g.flatten() for g in grads.values()]).norm().item()
    for rank in range(two_ranks.WORLD):
        saved = torch.load(spawned / f"ddp{rank}.pt")
        for name, value in expected.items():
            difference = (saved["weights"][name] - value).abs().max().item()
            assert difference <= 1e-12, (
                f"rank {rank}'s {name} after the DDP step is off one big batch's mean-loss step by "
                f"{difference:.3g}: the processes' gradients do not average to the mean loss's"
                " (step_loss's num_processes? step_items' sum over processes?)"
            )
        assert saved["grad_norm"] == pytest.approx(norm, rel=1e-12, abs=0), f"rank {rank}'s gradient norm"


def test_summary_ranks_lists_each_rank_s_own_figures_once_in_rank_order(spawned):
    """Each rank handed ``write_rank_figures`` mem/step_peak_bytes = 1000 + its rank, and an
    eval/loss that is no rank's own figure."""
    written = json.loads((spawned / RANKS).read_text())
    expected = [{"env/rank": 0, "mem/step_peak_bytes": 1000}, {"env/rank": 1, "mem/step_peak_bytes": 1001}]
    assert written == expected, f"{RANKS} holds {written}, not each rank's own figures in rank order"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_two_processes_with_k_equal_one_process_with_2k(tmp_path, backend):
    # checkpoint_every=8: the only checkpoint is the final one, whose weights are compared below
    parallel = torchrun(
        *DDP, f"backend={backend}", "gradient_accumulation_steps=2", "checkpoint_every=8",
        "logger=wandb", "logger.mode=offline", cwd=tmp_path,
    )  # fmt: skip
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    # Both ranks used one folder (Hydra names it from the clock): exactly one run folder exists,
    # holding one summary and one metrics file written by rank 0 alone.
    folders = [p.parent for p in (tmp_path / "outputs").glob("*/*/.hydra")]
    assert len(folders) == 1
    parallel_dir = folders[0]
    summary = json.loads((parallel_dir / "summary.json").read_text())
    assert (summary["cfg/world_size"], summary["env/rank"], summary["cfg/effective_batch_size"]) == (2, 0, 16)
    lines = read_metrics(parallel_dir)
    assert [line["step"] for line in lines] == list(range(1, 9))  # one line per step, not one per rank
    assert parallel.stdout.count("effitrain: ok:") == 1
    assert len(list(parallel_dir.glob("wandb/offline-run-*"))) == 1  # one W&B run, from rank 0

    single_dir = tmp_path / "single"
    single = train_py(
        *DDP,
        f"backend={backend}",
        "gradient_accumulation_steps=4",
        "checkpoint_every=8",
        f"hydra.run.dir={single_dir}",
    )
    assert single.returncode == 0, single.stderr[-3000:]
    reference = read_metrics(single_dir)
    for ddp_line, one_line in zip(lines, reference, strict=True):
        assert ddp_line["train/samples"] == one_line["train/samples"]
        assert ddp_line["lr"] == pytest.approx(one_line["lr"], rel=1e-12)
        assert ddp_line["train/loss"] == pytest.approx(one_line["train/loss"], rel=1e-5)
        assert ddp_line["grad_norm"] == pytest.approx(one_line["grad_norm"], rel=1e-4)
    single_summary = json.loads((single_dir / "summary.json").read_text())
    for key in ("eval/loss", "eval/accuracy", "eval/f1"):
        assert summary[key] == pytest.approx(single_summary[key], rel=1e-5)
    assert summary["eval/samples"] == single_summary["eval/samples"] == 24

    [parallel_weights] = parallel_dir.glob("checkpoints/step-*/model.safetensors")
    [single_weights] = single_dir.glob("checkpoints/step-*/model.safetensors")
    a, b = load_file(parallel_weights), load_file(single_weights)
    assert a.keys() == b.keys()
    # zero-gradient noise, see test_equivalence
    names = [n for n in a if not n.endswith("attention.self.key.bias")]
    assert relative_difference(a, b, names) < 1e-5


@pytest.mark.slow
def test_lora_on_two_processes_with_k_equals_one_process_with_2k(tmp_path):
    # no LoRA dropout: each process draws its own masks, one process draws them in another order
    common = [*DDP, "adapter=lora", "adapter.lora_dropout=0.0", "max_steps=4"]
    parallel = torchrun(
        *common, "gradient_accumulation_steps=2", f"hydra.run.dir={tmp_path / 'ddp'}", cwd=tmp_path
    )
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    single = train_py(*common, "gradient_accumulation_steps=4", f"hydra.run.dir={tmp_path / 'single'}")
    assert single.returncode == 0, single.stderr[-3000:]
    lines, reference = read_metrics(tmp_path / "ddp"), read_metrics(tmp_path / "single")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for ddp_line, one_line in zip(lines, reference, strict=True):
        assert ddp_line["train/samples"] == one_line["train/samples"]
        assert ddp_line["train/loss"] == pytest.approx(one_line["train/loss"], rel=1e-5)
        assert ddp_line["grad_norm"] == pytest.approx(one_line["grad_norm"], rel=1e-4)
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("ddp", "single")]
    assert summaries[0]["params/trainable"] == summaries[1]["params/trainable"] < summaries[0]["params/total"]
    assert summaries[0]["eval/loss"] == pytest.approx(summaries[1]["eval/loss"], rel=1e-5)


@pytest.mark.slow
def test_each_rank_destroys_its_process_group_before_the_interpreter_ends(tmp_path):
    """A gloo group left to the interpreter's end aborts a rank now and then (a C++ terminate):
    the group joined through ``process_state`` is destroyed at exit. Exit handlers run last
    registered first, so the one registered before joining sees the group after effitrain's."""
    script = tmp_path / "join.py"
    script.write_text(
        "import atexit, os, torch.distributed as dist\n"
        "from effitrain.train.distributed import process_state\n"
        "report = lambda: open(os.environ['OUT'] + os.environ['RANK'], 'w').write(str(dist.is_initialized()))\n"
        "atexit.register(report)\n"
        "state = process_state()\n"
        "assert dist.is_initialized() and state.num_processes == 2\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp_path / "rank"), PYTHONPATH=str(REPO))
    done = subprocess.run([*command, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["False", "False"]
