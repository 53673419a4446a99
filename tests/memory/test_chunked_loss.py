"""Chunked cross-entropy (``loss_chunks=N``): the same summed loss over the same tokens, its only
difference the order fp32 sums are added in (tolerances derived below); the whole logits never made;
the step predicted to the byte, its saving equal to a hand count of the logits' bytes; refused in one
line where it cannot apply.

The tolerance. Every logit row is the same float in both paths (a row of the head's matmul does not
depend on how many rows are computed with it on this CPU: the test below holds every other gradient
bit-identical). What differs: (1) the loss, a sum of n non-negative fp32 per-token losses, added as one
reduction or as N partial sums; (2) the head weight's gradient, each entry a sum over the n tokens of
hidden x logit-gradient, one matmul or N accumulated. Reordering a sum of n terms moves it by at most
gamma_(n-1) * sum|terms| each way (Higham, Accuracy and Stability, 4.2; gamma_k = k u / (1 - k u),
u = 2^-24), so the two differ by at most 2 gamma_n sum|terms|: for the loss 2 gamma_n L (its terms are
all >= 0). Over a run, AdamW's update m/(sqrt(v) + eps) is scale-free in the gradient: a relative
change rho of a gradient moves an update by at most 2 rho lr (first order), and adding it to a weight
rounds to within one ulp of the weight; so after k steps each weight differs by at most
k (2 rho lr + ulp(max|w|)), rho = 2 gamma_n, and step k's loss by k 2 gamma_n L_k.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from effitrain.config.errors import ConfigError
from effitrain.config.summary_schema import CATEGORIES
from effitrain.config.techniques import LOSS_CHUNKS, check_techniques, described, replay_keys
from tests.helpers.run import compose, final_weights, read_metrics, run_job, train_py

U = 2.0**-24  # fp32's unit roundoff
CAUSAL = ["task=causal_lm", "model=llama_tiny", "max_length=64"]


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


class LargestLastDim(TorchDispatchMode):
    """The most elements of any tensor an operator makes whose last dimension is ``size``, but for
    those shaped ``besides`` (the head weight's gradient, hidden x vocabulary)."""

    def __init__(self, size: int, besides: tuple):
        super().__init__()
        self.size, self.besides, self.largest = size, besides, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(tensor) and tensor.dim() and tensor.shape[-1] == self.size \
                    and tuple(tensor.shape) != self.besides:  # fmt: skip
                self.largest = max(self.largest, tensor.numel())
        return out


def tiny_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2))  # fmt: skip


def test_chunks_sum_the_same_tokens_within_the_reordering_bound_and_never_hold_the_whole_logits():
    from effitrain.train.tasks import CausalLM

    vocab, rows, length, chunks = 1000, 4, 17, 4
    model = tiny_llama(vocab)
    LOSS_CHUNKS.apply(model, compose(*CAUSAL, f"loss_chunks={chunks}"))  # chunks recomputed in backward
    ids = torch.randint(vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # a padded row: its positions from 10 on are no target
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    results = {}
    for n in (1, chunks):
        task = CausalLM()
        task.loss_chunks = n
        model.zero_grad()
        with LargestLastDim(vocab, (32, vocab)) as seen:
            loss = task.loss_sum(model, batch)
            loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results[n] = loss.detach(), grads, seen.largest, task.row_sums(model, batch)
    (plain, plain_grads, plain_largest, plain_rows), (chunked, grads, largest, rows_) = (
        results[1],
        results[chunks],
    )

    # the whole logits (rows x length x vocab) made by the plain path; one chunk's at most by the chunked
    assert plain_largest == rows * length * vocab
    assert largest == rows * math.ceil((length - 1) / chunks) * vocab

    # the loss: n real targets (padding is no target), a sum reordered
    n = int((batch["labels"][:, 1:] != -100).sum())
    assert n == rows * (length - 1) - (length - 1 - 9)
    assert abs(chunked.item() - plain.item()) <= 2 * gamma(n) * plain.item()
    # an independent count: the mean of float64 log-softmax picks over the same targets
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = (hidden[:, :-1].double() @ model.lm_head.weight.double().T).log_softmax(-1)
        targets = batch["labels"][:, 1:]
        picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        exact = -(picked * (targets != -100)).sum().item()
    assert chunked.item() == pytest.approx(exact, rel=1e-5)

    # every gradient but the head's bit-identical; the head's within 2 gamma_n sum_t |h_t| |dlogit_t|
    head = "lm_head.weight"
    assert all(torch.equal(grads[k], plain_grads[k]) for k in grads if k != head)
    with torch.no_grad():
        d_logits = logits.exp() - F.one_hot(targets.clamp(min=0), vocab).double()
        d_logits = d_logits * (targets != -100).unsqueeze(-1)
        bound = 2 * gamma(n) * (d_logits.abs().flatten(0, 1).T @ hidden[:, :-1].double().abs().flatten(0, 1))
    assert ((grads[head].double() - plain_grads[head].double()).abs() <= bound).all()
    # evaluation's per-row sums, chunked too: each row a sum of at most length - 1 terms
    assert torch.all(
        (rows_.double() - plain_rows.double()).abs() <= 2 * gamma(length - 1) * plain_rows.double()
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([*CAUSAL, "loss_chunks=0"], "loss_chunks=0 is invalid: must be an integer >= 1 (1: the whole logits at once; N: the LM head and loss over N chunks)"),
        (["loss_chunks=2"], "loss_chunks=2 is invalid: chunks split a causal LM's logits over positions: with task=classification give 1"),
        ([*CAUSAL, "loss_chunks=64"], "loss_chunks=64 is invalid: at most the 63 target positions of a max_length=64 row (max_length - 1)"),
        ([*CAUSAL, "loss_chunks=4", "compile=on"], "loss_chunks=4 is invalid: the chunked head is not built for torch.compile: give 1, or compile=off"),
        ([*CAUSAL, "loss_chunks=4", "parallel=fsdp"], "loss_chunks=4 is invalid: the chunked head is not built for FSDP sharding: give 1, or parallel=ddp"),
        ([*CAUSAL, "loss_chunks=4", "model.architecture.model_type=gemma2"],
         "loss_chunks=4 is invalid: Gemma2's forward changes its LM head's output before returning logits (final_logit_softcapping=30.0), which chunks would skip: give 1"),
    ],
)  # fmt: skip
def test_a_value_it_cannot_take_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as refused:
        check_techniques(compose(*overrides))
    assert str(refused.value) == message


def test_the_miniature_finds_a_forward_that_changes_the_heads_output():
    """Cohere scales its logits after the head (logit_scale): found on a miniature, not by name."""
    from transformers import CohereConfig, LlamaConfig

    from effitrain.config.techniques.chunked_head import logits_are_the_heads

    small = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 2}  # fmt: skip
    assert logits_are_the_heads(CohereConfig(**small)) is False
    assert logits_are_the_heads(CohereConfig(**small, logit_scale=1.0)) is True
    assert logits_are_the_heads(LlamaConfig(**small)) is True


def test_its_key_plan_axis_and_words():
    on, off = compose(*CAUSAL, "loss_chunks=8"), compose(*CAUSAL)
    check_techniques(on)
    assert replay_keys(on)["loss_chunks"] == 8 and replay_keys(off)["loss_chunks"] == 1
    assert "loss_chunks=8" in described(on).split(", ") and "loss_chunks" not in described(off)  # off: unsaid
    assert LOSS_CHUNKS.plan_values(off, False, (1, 4, 8, 100)) == [1, 4, 8]  # 100 > the 63 positions
    assert LOSS_CHUNKS.plan_values(off, False) == [1, 8]  # its own: torchtune's 8
    assert (LOSS_CHUNKS.recomputes(on), LOSS_CHUNKS.recomputes(off)) == (True, False)
    assert LOSS_CHUNKS.plan_values(on, True) == [8]
    assert LOSS_CHUNKS.plan_values(compose(), False, (1, 8)) == [1]  # a classifier
    assert LOSS_CHUNKS.override(4) == "loss_chunks=4"


@pytest.mark.slow
def test_four_chunks_train_as_one_within_the_bound_predicted_to_the_byte_saving_the_logits(tmp_path):
    """Packed rows of exactly 64 tokens, 8 rows a step: the plain step's peak holds the logits
    (rows x 64 x vocab fp32), their shifted, flattened copy and its log-softmax (rows x 63 x vocab
    each); the chunked one, in backward, one chunk's recomputed logits, their log-softmax and its
    gradient (rows x 16 x vocab each: 63 positions in 4 chunks) and the head weight's gradient
    (hidden x vocab) autograd holds while the chunks' parts are summed. The rest (hidden-sized) is
    at most two rows x 64 x hidden tensors apart."""
    rows, length, vocab, hidden, chunks, steps = 8, 64, 30522, 32, 4, 4
    common = [*CAUSAL, "data=synthetic", "data.packing=true", "data.num_train=64", "data.words_per_text=60",
              f"micro_batch_size={rows}", f"max_steps={steps}", f"checkpoint_every={steps}", "eval_batch_size=16"]  # fmt: skip
    runs = {}
    for n in (1, chunks):
        summary = run_job(tmp_path / str(n), *common, f"loss_chunks={n}")
        assert summary["status"] == "ok", summary.get("error")
        measured = {c: summary[f"mem/step_peak/{c}_bytes"] for c in CATEGORIES}
        assert measured == {c: summary[f"mem/step_peak_predicted/{c}_bytes"] for c in CATEGORIES}
        runs[n] = summary
    plain, chunked = read_metrics(tmp_path / "1"), read_metrics(tmp_path / str(chunks))
    tokens = rows * (length - 1)  # a step's targets: every row full
    assert [line["train/tokens"] for line in plain] == [tokens * k for k in range(1, steps + 1)]
    for k, (a, b) in enumerate(zip(plain, chunked), start=1):
        assert abs(a["train/loss"] - b["train/loss"]) <= k * 2 * gamma(tokens) * a["train/loss"], k
    lr = 1e-3  # conf/task/causal_lm.yaml's peak learning rate
    a, b = final_weights(tmp_path / "1"), final_weights(tmp_path / str(chunks))
    for name in a:
        ulp = torch.finfo(torch.float32).eps * a[name].abs().max().item()
        assert (a[name] - b[name]).abs().max().item() <= steps * (2 * 2 * gamma(tokens) * lr + ulp), name
    print("largest loss difference", max(abs(x["train/loss"] - y["train/loss"]) for x, y in zip(plain, chunked)),
          "largest weight difference", max((a[k] - b[k]).abs().max().item() for k in a))  # fmt: skip
    eval_tokens = runs[1]["eval/tokens"]
    assert (
        abs(runs[1]["eval/loss"] - runs[chunks]["eval/loss"]) <= 2 * gamma(eval_tokens) * runs[1]["eval/loss"]
    )

    def held(summary):
        return summary["mem/step_peak/activations_bytes"] + summary["mem/step_peak/temporaries_bytes"]

    saving = held(runs[1]) - held(runs[chunks])
    chunk = math.ceil((length - 1) / chunks)
    logits = rows * length * vocab * 4 + 2 * rows * (length - 1) * vocab * 4
    hand = logits - 3 * rows * chunk * vocab * 4 - hidden * vocab * 4
    print(f"saving {saving:,} bytes, hand count {hand:,}")
    assert 0 <= hand - saving <= 2 * rows * length * hidden * 4, (hand, saving)


@pytest.mark.slow
def test_the_cuda_profile_replays_chunks_recomputed_under_its_autocast():
    from effitrain.commands.estimate import estimate_memory

    peaks = {}
    for n in (1, 4):
        cfg = compose(*CAUSAL, "micro_batch_size=4", "precision=bf16", f"loss_chunks={n}", tiny=False)
        [row] = estimate_memory(cfg, device="cuda").values()  # recomputed in fp32: CheckpointError
        peaks[n] = row["step_peak"]["activations_bytes"] + row["step_peak"]["temporaries_bytes"]
    # bf16 logits of 4 x 64 x 30522 and their fp32 copy: far more than a chunk's
    assert peaks[4] < peaks[1] - 4 * 63 * 30522 * (2 + 4)


@pytest.mark.slow
def test_model_flops_leave_the_recomputation_out_and_the_recomputed_flops_are_the_heads_forward():
    """Model FLOPs (recomputation not counted, as MFU is defined): the chunks' matmuls are the plain
    head's but for the last position, which has no target: its forward (2 x rows x hidden x vocab)
    and backward (twice that) are all the difference. What the chunks recompute (plan's cost of the
    lever): the head's forward over the 63 target positions of each row."""
    from effitrain.commands.estimate import estimate_memory

    rows, hidden, vocab = 8, 32, 30522
    flops, recomputed = {}, {}
    for n in (1, 4):
        cfg = compose(*CAUSAL, "data.packing=true", f"micro_batch_size={rows}", f"loss_chunks={n}")
        [row] = estimate_memory(cfg, cache=False).values()
        flops[n], recomputed[n] = row["flops_per_step"], row.get("recomputed_flops_per_step") or 0
    assert flops[1] - flops[4] == 6 * rows * hidden * vocab
    assert recomputed == {1: 0, 4: 2 * rows * 63 * hidden * vocab}


@pytest.mark.slow
def test_two_processes_with_chunks_train_as_one_process_with_twice_the_accumulation(tmp_path):
    """DDP runs the model's own forward (its hooks see each chunk's use of the head weight as one
    gradient): two processes with loss_chunks=4 equal one with k=2 and the plain loss, within the
    data-parallel test's 1e-5 (tests/train/test_distributed.py) plus the reordering bound above."""
    import json

    from tests.train.test_distributed import torchrun

    common = [*CAUSAL, "max_length=32", "data=synthetic", "data.num_train=32", "micro_batch_size=4", "max_steps=3",
              "logger=none", "progress_bar=false"]  # fmt: skip
    parallel = torchrun(*common, "loss_chunks=4", f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    single = train_py(*common, "gradient_accumulation_steps=2", f"hydra.run.dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr[-3000:]
    two, one = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert len(two) == len(one) == 3
    for k, (a, b) in enumerate(zip(two, one), start=1):
        tokens = int(b["train/tokens"] - (one[k - 2]["train/tokens"] if k > 1 else 0))
        assert abs(a["train/loss"] - b["train/loss"]) <= (1e-5 + k * 2 * gamma(tokens)) * b["train/loss"]
    eval_two, eval_one = (
        json.loads((tmp_path / d / "summary.json").read_text())["eval/loss"] for d in ("two", "one")
    )
    assert eval_two == pytest.approx(eval_one, rel=1e-5)


@pytest.mark.slow
def test_plan_proposes_chunks_where_they_make_the_budget_fit_without_accumulation():
    """A budget between the chunked and the plain peak of micro batch 8 (the logits set the step's
    peak): plan's best candidate trains at micro batch 8 without accumulation, with loss_chunks=8."""
    from effitrain.commands.estimate import estimate_memory
    from effitrain.commands.plan import plan

    base = [*CAUSAL, "data=synthetic", "eval_batch_size=4"]

    def peak(chunks: int) -> int:
        cfg = compose(*base, "optimizer=adafactor", "micro_batch_size=8", f"loss_chunks={chunks}", tiny=False)
        [row] = estimate_memory(cfg, {"adafactor": cfg.optimizer}).values()
        return row["run_peak_bytes"]

    chunked, plain = peak(8), peak(1)
    assert chunked < plain
    rows = plan(base, (chunked + plain) // 2, effective=8, optimizers=["adafactor"], precisions=["fp32"],
                checkpointing=[False], margin=0.0)  # fmt: skip
    best = rows[0]
    assert (best["micro_batch_size"], best["gradient_accumulation_steps"], best["fits"]) == (8, 1, True)
    assert best["run_peak_bytes_predicted"] == chunked
    assert best["command"].endswith("gradient_accumulation_steps=1 loss_chunks=8")
