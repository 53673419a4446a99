"""Absolute references: the figures effitrain reports, against values computed here without
effitrain's code (torch.autograd of the whole batch's mean loss as transformers computes it, an
AdamW step written out, FLOPs counted by hand, scikit-learn's F1, Llama's norms), so a bug that
both sides of an equivalence test would share still fails here.

fp32, CPU, tiny models, one optimizer step."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.run import REPO, ParamSnapshots, compose, fit

NO_DROPOUT = [
    "+model.config_overrides.hidden_dropout_prob=0.0",
    "+model.config_overrides.attention_probs_dropout_prob=0.0",
]
# one optimizer step of 2 micro-batches of 4 rows of different lengths (so padding differs between
# them), a constant lr from the first step, clipping at a norm far below the gradient's
LR, EPS, WEIGHT_DECAY, MAX_NORM = 1e-2, 1e-3, 0.1, 1e-2
ONE_STEP = [
    "micro_batch_size=4", "gradient_accumulation_steps=2", "max_steps=1", "lr_scheduler=constant",
    "warmup_ratio=0", f"optimizer.lr={LR}", f"optimizer.eps={EPS}", f"weight_decay={WEIGHT_DECAY}",
    f"max_grad_norm={MAX_NORM}", "data.min_words_per_text=3", "logger=none", "progress_bar=false",
]  # fmt: skip
TASKS = {
    "classification": ["model=tiny", "data=synthetic", *NO_DROPOUT],
    "causal_lm": ["task=causal_lm", "model=llama_tiny", "data=synthetic", "max_length=32"],
}


def one_batch(window: list[dict], pad_id: int) -> dict:
    """The window's micro-batches as one right-padded batch (attention mask 0, label -100 on padding)."""
    length = max(batch["input_ids"].shape[1] for batch in window)
    fill = {"input_ids": pad_id, "attention_mask": 0, "token_type_ids": 0, "labels": -100}
    merged = {}
    for key in window[0]:
        parts = []
        for batch in window:
            value = batch[key]
            if value.dim() == 2 and value.shape[1] < length:
                value = torch.nn.functional.pad(value, (0, length - value.shape[1]), value=fill[key])
            parts.append(value)
        merged[key] = torch.cat(parts)
    return merged


def first_step(tmp_path, task: str, backend: str):
    """One optimizer step of ``task`` on ``backend``, with the references computed before it from the
    step's rows as one batch: transformers' own mean loss and ``torch.autograd.grad`` of it.

    Returns (reference loss, reference gradients, parameters before, the step's gradients as the
    optimizer saw them, the parameters after it, the step's metrics line, the job)."""
    from effitrain.config.validate import validate
    from effitrain.run.build import build_job

    cfg = compose(*TASKS[task], f"backend={backend}", *ONE_STEP, tiny=False)
    validate(cfg)
    snapshots = ParamSnapshots()
    job = build_job(cfg, tmp_path, [snapshots], torch.device("cpu"), True)
    snapshots.model = model = job.model
    names = {param: name for name, param in model.named_parameters()}

    job.train_loader.sampler.set_epoch(0)
    window = [batch for _, batch in zip(range(2), job.train_loader)]
    big = one_batch(window, pad_id=0)
    rows = big["labels"] if task == "classification" else big["labels"][:, 1:]
    assert (rows != -100).sum() > 0 and len(big["labels"]) == 8
    model.train()
    reference_loss = model(**big).loss  # transformers' mean: over the rows, or the real next tokens
    params = [p for p in model.parameters() if p.requires_grad]
    reference_grads = dict(zip((names[p] for p in params), torch.autograd.grad(reference_loss, params)))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    seen = {}

    def record_gradients(optimizer, args, kwargs):
        seen.update({names[p]: p.grad.clone() for group in optimizer.param_groups for p in group["params"]})

    job.optimizer.register_step_pre_hook(record_gradients)
    fit(job)
    [line] = snapshots.lines
    return reference_loss.item(), reference_grads, before, seen, snapshots.params[0], line, job


@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
@pytest.mark.parametrize("task", ["classification", "causal_lm"])
def test_first_step_against_autograd_and_a_hand_written_adamw_step(tmp_path, task, backend):
    loss, grads, before, seen, after, line, job = first_step(tmp_path, task, backend)

    # train/loss: transformers' loss of the step's 8 rows as one batch (a causal LM's: over real
    # target tokens, not rows)
    assert line["train/loss"] == pytest.approx(loss, rel=1e-5)
    # grad_norm: the norm of the whole batch's mean-loss gradient, before clipping
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    assert line["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert norm > 10 * MAX_NORM  # so clipping really acts
    # what the optimizer stepped on: that gradient clipped to max_grad_norm (torch's 1e-6 guard)
    scale = MAX_NORM / (norm + 1e-6)
    assert seen.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(seen[name], grad * scale, rtol=1e-4, atol=1e-9, msg=name)

    # AdamW's first step, by hand: m/(1 - b1) = g, sqrt(v/(1 - b2)) = |g|; decoupled decay where
    # the parameter is a matrix (biases and norm weights never decay)
    for name, p0 in before.items():
        g = grads[name] * scale
        decay = WEIGHT_DECAY if p0.dim() >= 2 else 0.0
        expected = p0 * (1 - LR * decay) - LR * g / (g.abs() + EPS)
        torch.testing.assert_close(after[name], expected, rtol=1e-5, atol=1e-7, msg=name)
    assert line["lr"] == LR
    rows = 8 if task == "classification" else None
    if rows:
        assert line["train/samples"] == rows


class _FixedLogits(torch.nn.Module):
    """A classifier whose logits are given: row i of a batch gets ``logits[batch["row"][i]]``."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, row, **_):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.logits[row])


class _OneProcess:
    def gather_for_metrics(self, values):
        return values


def test_eval_metrics_count_a_predicted_but_absent_class():
    from sklearn.metrics import f1_score

    from effitrain.train.tasks import Classification

    labels = [0, 0, 1, 1, 1, 0]
    predicted = [0, 2, 1, 1, 0, 0]  # class 2 is predicted once and never the label
    logits = torch.full((6, 3), -1.0)
    logits[torch.arange(6), torch.tensor(predicted)] = 2.0
    batches = [
        {"row": torch.tensor(rows), "labels": torch.tensor([labels[i] for i in rows])}
        for rows in ([0, 1, 2, 3], [4, 5])
    ]
    metrics = Classification().evaluate(_FixedLogits(logits), batches, _OneProcess())

    # by hand: class 0: 2 hits of 3 predicted, 3 real -> 2/3; class 1: 2 of 2, 3 real -> 4/5;
    # class 2: 0 of 1, 0 real -> 0. Left out (the bug), the mean would be 11/15.
    assert metrics["eval/f1"] == pytest.approx((2 / 3 + 4 / 5 + 0) / 3, abs=1e-12)
    assert metrics["eval/f1"] == pytest.approx(f1_score(labels, predicted, average="macro"), abs=1e-12)
    assert metrics["eval/accuracy"] == pytest.approx(4 / 6, abs=1e-7)
    hit, miss = (
        -math.log(math.exp(2) / (math.exp(2) + 2 * math.exp(-1))),
        -math.log(math.exp(-1) / (math.exp(2) + 2 * math.exp(-1))),
    )
    assert metrics["eval/loss"] == pytest.approx((4 * hit + 2 * miss) / 6, rel=1e-6)
    assert metrics["eval/samples"] == 6


def _job(index: int, optimizer: str, state_mib: int, peak_mib: int | None, status: str | None = "ok",
         choices: dict | None = None):  # fmt: skip
    from pathlib import Path

    from effitrain.compare.load import JobResult

    summary = {"status": status, "cfg/optimizer": optimizer, "mem/optimizer_state_bytes": state_mib * 2**20}
    if peak_mib is not None:
        summary["mem/step_peak_bytes"] = peak_mib * 2**20
    if status is None:  # a job that wrote no summary
        del summary["status"]
    choices = {"optimizer": optimizer} if choices is None else choices
    return JobResult(Path("s"), Path("s", f"job{index}"), summary, {}, choices=choices)


@pytest.mark.parametrize(
    "jobs, title, rows",
    [
        # AdamW is not first: the ratios are against it, not against the first job
        (
            [("adafactor", 100, 1000), ("adamw", 800, 4000), ("adam8bit", 200, 2000)],
            "x AdamW",
            [["adafactor", "ok", "100.00", "0.125", "1000.0", "0.250"],
             ["adamw", "ok", "800.00", "1.000", "4000.0", "1.000"],
             ["adam8bit", "ok", "200.00", "0.250", "2000.0", "0.500"]],
        ),
        # a failed AdamW is no baseline: the first finished job is; a job without a status is "missing"
        (
            [("adamw", 800, 4000, "oom"), ("adafactor", 100, 1000), ("adam8bit", 300, 1500),
             ("sgd", 0, 500, None)],
            "x job 2",
            [["adamw", "oom", "800.00", "8.000", "4000.0", "4.000"],
             ["adafactor", "ok", "100.00", "1.000", "1000.0", "1.000"],
             ["adam8bit", "ok", "300.00", "3.000", "1500.0", "1.500"],
             ["sgd", "missing", "0.00", "0.000", "500.0", "0.500"]],
        ),
        # two optimizers, one of them AdamW (second)
        (
            [("adafactor", 100, 1000), ("adamw", 800, 4000)],
            "x AdamW",
            [["adafactor", "ok", "100.00", "0.125", "1000.0", "0.250"],
             ["adamw", "ok", "800.00", "1.000", "4000.0", "1.000"]],
        ),
        # a baseline of 0 bytes (plain SGD keeps no state) gives no ratio, not a division by zero
        (
            [("sgd", 0, 1000), ("adafactor", 100, 2000)],
            "x job 1",
            [["sgd", "ok", "0.00", "1000.0", "1.000"], ["adafactor", "ok", "100.00", "2000.0", "2.000"]],
        ),
        # no AdamW at all: against job 1; a baseline without the figure has no ratios of it, and a
        # column that no job has a value in is left out
        (
            [("adafactor", 400, None), ("adam8bit", 100, 3000)],
            "x job 1",
            [["adafactor", "ok", "400.00", "1.000", ""], ["adam8bit", "ok", "100.00", "0.250", "3000.0"]],
        ),
        # only AdamW (the optimizer does not vary): against job 1, not "AdamW"
        (
            [("adamw", 800, 4000), ("adamw", 400, 1000)],
            "x job 1",
            [["adamw", "ok", "800.00", "1.000", "4000.0", "1.000"], ["adamw", "ok", "400.00", "0.500", "1000.0", "0.250"]],
        ),
    ],
)  # fmt: skip
def test_compare_table_on_known_summaries(jobs, title, rows):
    from effitrain.compare.table import table_rows

    headers, table = table_rows([_job(i, *values) for i, values in enumerate(jobs)])
    columns = ["optimizer", "status", "opt state MiB", title, "step peak MiB", title]
    if jobs[0][:2] == ("sgd", 0):  # no job has a ratio of the optimizer state: that column is left out
        columns.remove(title)
    # the job numbers of the page and its plots come first
    assert headers[0] == "#" and [row[0] for row in table] == [str(i) for i in range(1, len(jobs) + 1)]
    assert headers[1:] == columns[: len(rows[0])]
    assert [row[1:] for row in table] == rows


def test_compare_table_names_jobs_by_their_choices_or_their_folder():
    from effitrain.compare.table import table_rows

    jobs = [
        _job(0, "adamw", 800, 4000, choices={"optimizer": "adamw"}),
        _job(1, "adamw", 800, 2000, choices={"optimizer": "adamw", "gradient_accumulation_steps": "4"}),
    ]
    headers, rows = table_rows(jobs)
    assert headers[:4] == ["#", "optimizer", "gradient_accumulation_steps", "status"]
    assert [row[:4] for row in rows] == [["1", "adamw", "", "ok"], ["2", "adamw", "4", "ok"]]
    headers, rows = table_rows(
        [_job(0, "adamw", 800, 4000, choices={}), _job(1, "adamw", 400, 4000, choices={})]
    )
    assert headers[:3] == ["#", "job", "status"]
    assert [row[:3] for row in rows] == [["1", "job0", "ok"], ["2", "job1", "ok"]]


MODELS = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))


@pytest.mark.parametrize("model", MODELS)
def test_no_decay_holds_exactly_the_one_dimensional_parameters_of_every_shipped_model(model):
    """Biases and normalization weights (LayerNorm, Llama's RMSNorm) are exactly the parameters with
    one dimension in these architectures; every matrix (embeddings included) decays."""
    from effitrain.train.modeling import build_model
    from effitrain.train.optim import param_groups

    cfg = compose(f"model={model}", "model.init=random", tiny=False)
    auto_classes = ["AutoModelForSequenceClassification"]
    if cfg.model.architecture.get("model_type") == "llama":
        auto_classes.append("AutoModelForCausalLM")
    for auto_class in auto_classes:
        net = build_model(cfg.model, 3 if "Sequence" in auto_class else None, None, "meta", auto_class)
        decay, no_decay = param_groups(net, weight_decay=0.1)
        names = {id(p): n for n, p in net.named_parameters()}
        expected = {n for n, p in net.named_parameters() if p.dim() < 2}
        assert {names[id(p)] for p in no_decay["params"]} == expected, (model, auto_class)
        assert {names[id(p)] for p in decay["params"]} == set(names.values()) - expected
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
        norms = [m for m in net.modules() if "RMSNorm" in type(m).__name__]
        if cfg.model.architecture.get("model_type") == "llama":  # 2 per layer and the final one
            assert len(norms) == 2 * cfg.model.architecture.num_hidden_layers + 1
            assert all(id(m.weight) in {id(p) for p in no_decay["params"]} for m in norms)


def test_a_job_that_did_not_finish_ok_holds_no_best_value():
    """An interrupted job's short wall time or partial state is not a column's best."""
    from effitrain.compare.table import best_cells

    headers = ["#", "status", "opt state MiB", "wall s"]
    rows = [
        ["1", "interrupted", "12.23", "27.4"],
        ["2", "ok", "173.30", "816.0"],
        ["3", "ok", "16.50", "1036.4"],
    ]
    assert best_cells(headers, rows, [False, True, True]) == {(2, 2), (1, 3)}
    assert best_cells(headers, rows) == {(0, 2), (0, 3)}


def test_best_cells_skip_empty_and_nan_cells_and_take_the_highest_where_higher_is_better():
    from effitrain.compare.table import best_cells

    headers = ["#", "optimizer", "eval loss", "accuracy", "samples/s", "job"]
    rows = [
        ["1", "adamw", "nan", "", "12.5", "3"],  # no eval: an empty or nan cell is no best
        ["2", "lion", "0.75", "0.5", "30.0", "1"],
        ["3", "sgd", "0.5", "0.75", "30.0", "2"],
    ]
    # lowest eval loss, highest accuracy, both fastest (a tie); "#" and "job" are no figures
    assert best_cells(headers, rows) == {(2, 2), (2, 3), (1, 4), (2, 4)}
    # without job 3, eval loss and accuracy have one value each: nothing to mark there
    assert best_cells(headers, rows, [True, True, False]) == {(1, 4)}
