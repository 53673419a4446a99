"""task=causal_lm: a decoder trained on next-token prediction, with the step's loss the token mean
over all its micro-batches and processes (so accumulation equals one big batch also when
micro-batches hold different numbers of real tokens), real-token counts, perplexity, compile,
checkpoints and resume, data parallel, bad input.

fp32, CPU, llama_tiny (no dropout), generated texts of 3 to 12 words."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from effitrain.config.errors import ConfigError
from effitrain.config.load import load
from effitrain.train.tasks import IGNORE_INDEX
from tests.backends.test_equivalence import assert_same_training
from tests.helpers.bad_inputs import HUB, files
from tests.helpers.run import (
    REPO,
    compose,
    final_weights,
    read_metrics,
    relative_difference,
    run_job,
    train_py,
)

# 58 texts: with an effective batch of 16 the last step of the epoch holds 10, so accumulation
# 4 x 4 ends on micro-batches of 4, 4 and 2 rows; lengths vary, so do the real tokens per micro-batch.
CAUSAL = [
    "task=causal_lm", "model=llama_tiny", "data=synthetic", "data.min_words_per_text=3",
    "data.num_train=58", "data.num_eval=16", "epochs=2", "max_length=32", "eval_batch_size=16",
    "optimizer.lr=3e-3", "warmup_ratio=0", "logger=none", "progress_bar=false",
]  # fmt: skip
PACKED = ["data.packing=true", "max_length=16"]


def causal(*overrides: str):
    return compose(*CAUSAL, *overrides, tiny=False)


def fit(tmp_path, *overrides: str):
    from effitrain.config.validate import validate
    from effitrain.run.build import build_job
    from effitrain.train.distributed import process_state
    from tests.helpers.run import ParamSnapshots
    from tests.helpers.run import fit as fit_job

    cfg = causal(*overrides)
    validate(cfg)
    snapshots = ParamSnapshots()
    job = build_job(cfg, tmp_path, [snapshots], process_state().device, True)
    snapshots.model = job.model
    return snapshots, fit_job(job), job


def real_targets(batch) -> int:
    """Counted here, not by the task: labels after the first position that are not padding."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


@pytest.mark.parametrize("layout", ["padded", pytest.param("packed", marks=pytest.mark.slow)])
@pytest.mark.parametrize("backend", ["accelerator", pytest.param("trainer", marks=pytest.mark.slow)])
def test_accumulation_equals_the_big_batch_with_tokens(tmp_path, backend, layout):
    extra = [f"backend={backend}", *(PACKED if layout == "packed" else [])]
    big, _, _ = fit(tmp_path / "big", "micro_batch_size=16", "gradient_accumulation_steps=1", *extra)
    accumulated, _, job = fit(tmp_path / "acc", "micro_batch_size=4", "gradient_accumulation_steps=4", *extra)
    assert len(big.lines) >= 4
    assert [line["train/tokens"] for line in big.lines] == [
        line["train/tokens"] for line in accumulated.lines
    ]
    assert_same_training(big, accumulated, param_rtol=1e-6, loss_rtol=1e-6)

    window = [batch for _, batch in zip(range(4), job.train_loader)]
    counts = [real_targets(batch) for batch in window]
    if layout == "padded":
        # the micro-batches really differ in real tokens, and there averaging each micro-batch on
        # its own (the bug) would give another loss than the token mean the step has
        assert len(set(counts)) > 1
        model = job.model
        with torch.no_grad():
            sums = [job.task.loss_sum(model, batch).item() for batch in window]
        token_mean = sum(sums) / sum(counts)
        mean_of_means = sum(s / c for s, c in zip(sums, counts)) / len(counts)
        assert abs(mean_of_means - token_mean) > 1e-4 * token_mean
    else:  # packed rows are all max_length tokens long, none of them padding
        assert counts == [len(batch["labels"]) * 15 for batch in window]


@pytest.mark.slow
def test_backends_compute_the_same_decoder_training(tmp_path):
    common = ["micro_batch_size=4", "gradient_accumulation_steps=3"]
    accel, accel_metrics, job = fit(tmp_path / "a", "backend=accelerator", *common)
    trainer, trainer_metrics, _ = fit(tmp_path / "t", "backend=trainer", *common)
    assert_same_training(accel, trainer, param_rtol=1e-6, loss_rtol=1e-5)
    for key in ("eval/loss", "eval/perplexity"):
        assert accel_metrics[key] == pytest.approx(trainer_metrics[key], rel=1e-5)

    # eval/loss is the token mean over the eval split: transformers' own loss of the trained model
    # on the whole split as one batch (16 rows) says the same; final: fit's final evaluation
    final = {key: value for key, value in accel_metrics.items() if key.startswith("eval/")}
    [batch] = list(job.eval_loader)
    with torch.no_grad():
        reference = job.model(**batch).loss.item()
    assert final["eval/loss"] == pytest.approx(reference, rel=1e-5)
    assert final["eval/perplexity"] == pytest.approx(math.exp(final["eval/loss"]), rel=1e-12)
    assert final["eval/tokens"] == real_targets(batch)
    assert "eval/accuracy" not in final and "eval/f1" not in final


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_token_counts_are_exact(tmp_path, layout):
    """train/tokens and eval/tokens against a count made from the tokenizer here."""
    from effitrain.train.data import load_synthetic
    from effitrain.train.modeling import build_tokenizer

    extra = PACKED if layout == "packed" else []
    summary = run_job(tmp_path, *CAUSAL, "epochs=1", *extra, tiny=False)
    assert summary["status"] == "ok", summary["error"]
    assert summary["cfg/task"] == "causal_lm"
    cfg = causal(*extra)
    tokenizer = build_tokenizer(cfg.model)
    raw = load_synthetic(58, 16, 3, 12, 0, min_words_per_text=3)
    length = cfg.max_length

    def targets(texts) -> int:
        rows = tokenizer(list(texts))["input_ids"]  # [CLS] ... [SEP]: [SEP] ends every document
        assert all(row[-1] == tokenizer.sep_token_id for row in rows)
        if layout == "packed":  # one stream, cut into rows of max_length, the remainder dropped
            return (sum(len(row) for row in rows) // length) * (length - 1)
        return sum(min(len(row), length) - 1 for row in rows)

    assert summary["train/tokens"] == targets(raw.train["text"])
    assert summary["eval/tokens"] == targets(raw.eval["text"])
    assert summary["speed/tokens_per_s"] == pytest.approx(summary["train/tokens"] / summary["speed/train_s"])
    assert summary["eval/perplexity"] == pytest.approx(math.exp(summary["eval/loss"]), rel=1e-12)
    lines = read_metrics(tmp_path)
    assert lines[-1]["train/tokens"] == summary["train/tokens"]


@pytest.mark.slow
def test_a_causal_lm_from_a_local_folder_loads_its_weights(tmp_path):
    """model.name_or_path= any causal LM folder (saved here, as the hub would give it)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from effitrain.run.build import build_job
    from effitrain.train.distributed import process_state
    from effitrain.train.modeling import build_tokenizer

    tokenizer = build_tokenizer(causal().model)
    torch.manual_seed(7)
    saved = LlamaForCausalLM(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    )  # fmt: skip
    folder = tmp_path / "my-llama"
    saved.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer.name_or_path).save_pretrained(folder)

    overrides = [f"model.name_or_path={folder}", f"model.tokenizer={folder}", "model.init=pretrained"]
    job = build_job(causal(*overrides), tmp_path / "run", [], process_state().device, True)
    assert type(job.model).__name__ == "LlamaForCausalLM"
    loaded = dict(job.model.named_parameters())
    assert loaded.keys() == dict(saved.named_parameters()).keys()
    assert all(torch.equal(loaded[name], p) for name, p in saved.named_parameters())
    summary = run_job(tmp_path / "trained", *CAUSAL, *overrides, "max_steps=2", tiny=False)
    assert summary["status"] == "ok", summary["error"]
    assert summary["params/total"] == sum(p.numel() for p in saved.parameters())
    with pytest.raises(ConfigError, match="max_length=100 is invalid: the model has 64 positions"):
        load([*CAUSAL, *overrides, "max_length=100"])


def test_a_text_only_file_is_enough_for_causal_lm_not_for_classification(csv_files):
    text_only = files(train="text_only.csv", test="text_only.csv").replace("{CSV}", str(csv_files))
    cfg = load(["task=causal_lm", "model=llama_tiny", *HUB, text_only])
    assert cfg.task._target_ == "effitrain.train.tasks.CausalLM"
    with pytest.raises(
        ConfigError, match="data.label_column='label' is invalid: no such column: choose one of text"
    ):
        load(["model=tiny", *HUB, text_only])


@pytest.mark.slow
def test_compile_changes_speed_not_the_numbers_of_the_decoder(tmp_path):
    from effitrain.train.modeling import build_model

    common = ["max_steps=6", "micro_batch_size=8", "compile.backend=aot_eager"]
    eager, _, _ = fit(tmp_path / "eager", "compile=off", *common)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled, _, job = fit(tmp_path / "compiled", "compile=on", *common)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before
    assert [line["train/loss"] for line in compiled.lines] == pytest.approx(
        [line["train/loss"] for line in eager.lines], abs=1e-3
    )
    state = job.model.state_dict()  # the uncompiled module's: loads into a plain decoder
    assert not [key for key in state if "_orig_mod" in key]
    fresh = build_model(job.cfg.model, None, job.tokenizer, auto_class="AutoModelForCausalLM")
    result = fresh.load_state_dict(state, strict=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_sigkill_then_resume_auto_is_bit_identical_for_the_decoder(tmp_path, backend):
    from tests.train.test_checkpoint import assert_bit_identical, final_weights, start_and_kill

    resumable = [*CAUSAL, f"backend={backend}", "epochs=3", "micro_batch_size=4", "gradient_accumulation_steps=2",
                 "checkpoint_every=3"]  # fmt: skip
    reference = run_job(tmp_path / "ref", *resumable, tiny=False)
    assert reference["status"] == "ok", reference["error"]
    run_dir = tmp_path / "killed"
    start_and_kill(run_dir, *resumable, at_step=4)
    resumed = train_py(*resumable, "resume=auto", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bit_identical(final_weights(tmp_path / "ref"), final_weights(run_dir))
    assert [line["train/loss"] for line in read_metrics(run_dir)][-3:] == [
        line["train/loss"] for line in read_metrics(tmp_path / "ref")
    ][-3:]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_with_k_equal_one_process_with_2k_on_tokens(tmp_path, parallel):
    """Each process holds micro-batches with other numbers of real tokens: the step divides the
    summed loss by the real tokens over both processes, as one process does; sharded (fsdp) or not."""
    from tests.train.test_distributed import torchrun

    common = [*CAUSAL, "micro_batch_size=4", "epochs=1", "data.num_train=64", "checkpoint_every=4"]
    two = torchrun(*common, f"parallel={parallel}", "gradient_accumulation_steps=2", "hydra.run.dir=two",
                   cwd=tmp_path)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    single = train_py(*common, "gradient_accumulation_steps=4", f"hydra.run.dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr[-3000:]
    lines, one = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert [line["train/tokens"] for line in lines] == [line["train/tokens"] for line in one]
    assert [line["train/loss"] for line in lines] == pytest.approx(
        [line["train/loss"] for line in one], rel=1e-5
    )
    a, b = final_weights(tmp_path / "two"), final_weights(tmp_path / "one")
    assert relative_difference(a, b) < 1e-5


@pytest.mark.slow
def test_the_default_causal_run_a_few_steps(tmp_path):
    """task=causal_lm's defaults: llama_small on the drug reviews' texts, cosine with warmup."""
    result = train_py("task=causal_lm", "max_steps=3", "logger=none", "progress_bar=false",
                      f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["cfg/task"], summary["cfg/model"], summary["cfg/lr_scheduler"]) == (
        "causal_lm",
        "llama_small",
        "cosine",
    )
    assert summary["train/steps"] == 3 and summary["eval/tokens"] > 0
    assert summary["eval/perplexity"] == pytest.approx(math.exp(summary["eval/loss"]))
    assert f"eval/perplexity {summary['eval/perplexity']:.4f}" in result.stdout


@pytest.mark.slow
def test_the_lm_memory_study_runs_and_compares(tmp_path):
    """sweep=lm_memory, as a user runs it (small), then compare on what it wrote: the language
    model's columns, not the classifier's; accumulation 4 lowers the step peak, the optimizers'
    state orders as their bytes per parameter."""
    import csv

    from effitrain.cli import main

    folder = tmp_path / "sweep"
    done = train_py("sweep=lm_memory", "model=llama_tiny", "data=synthetic", "max_steps=2", "logger=none",
                    "progress_bar=false", f"hydra.sweep.dir={folder}")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    main(["compare", str(folder)])
    rows = list(csv.DictReader((folder / "comparison.csv").open()))
    assert len(rows) == 6 and {row["status"] for row in rows} == {"ok"}
    by = {(row["optimizer"], row["gradient_accumulation_steps"]): row for row in rows}
    for optimizer in ("adamw", "adafactor", "adam8bit"):
        one, four = by[optimizer, "1"], by[optimizer, "4"]
        assert (one["micro_batch_size"], four["micro_batch_size"]) == ("32", "8")
        assert int(four["mem/step_peak_bytes"]) < int(one["mem/step_peak_bytes"])
        # 256 texts of 14 tokens = 56 packed rows of 64: a step of 32 rows, then the epoch's last 24
        assert one["train/tokens"] == four["train/tokens"] == str(56 * 63)
        assert float(one["eval/perplexity"]) == pytest.approx(math.exp(float(one["eval/loss"])))
        assert one["eval/accuracy"] == one["eval/f1"] == ""
    state = {
        opt: int(by[opt, "1"]["mem/optimizer_state_bytes"]) for opt in ("adamw", "adafactor", "adam8bit")
    }
    assert state["adafactor"] < state["adam8bit"] < state["adamw"]
    markdown = (folder / "comparison.md").read_text()
    assert "perplexity" in markdown and "accuracy" not in markdown


def causal_lm_models() -> list[str]:
    """Every option of conf/model that task=causal_lm accepts (``effitrain check`` passes)."""
    from effitrain.config.registry import group_options
    from effitrain.config.validate import validate

    accepted = []
    for option in group_options("model"):
        try:
            validate(compose("task=causal_lm", f"model={option}", "data=synthetic", tiny=False))
        except ConfigError:
            continue
        accepted.append(option)
    return accepted


def later_token_changes_earlier_outputs(model, t: int = 5, length: int = 9) -> bool:
    """Counted here, not by effitrain: logits at positions < t before and after the token at t changes."""
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (2, length), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[:, t] = (ids[:, t] + 17) % vocab
    model.eval()
    with torch.no_grad():
        before, after = (model(input_ids=x, attention_mask=torch.ones_like(x)).logits for x in (ids, changed))
    assert not torch.allclose(before[:, t:], after[:, t:])  # the change is seen from t on
    return not torch.allclose(before[:, :t], after[:, :t], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_causal_lm_accepts_encoders_only_built_causal():
    """Every model task=causal_lm accepts, built as a run builds it: the output at position t does not
    change when a later token changes. BERT (model=tiny, model=minilm) is built with is_decoder=True;
    the same BERT built as the encoder it is would see later tokens, as the check says."""
    from effitrain.commands.estimate import meta_model
    from effitrain.config.causality import sees_later_tokens
    from effitrain.run.build import build_job
    from effitrain.train.distributed import process_state
    from effitrain.train.modeling import build_config

    accepted = causal_lm_models()
    assert {"tiny", "minilm", "llama_tiny", "llama_small"} <= set(accepted)
    assert "distilbert_base_cased" not in accepted  # not a type AutoModelForCausalLM builds
    # a model this machine cannot hold (llama_7b: for estimates, built on fake tensors) is checked
    # through a model of its architecture that it can
    metas = {option: meta_model(causal(f"model={option}", "max_length=16")) for option in accepted}
    built = [o for o in accepted if sum(p.numel() for p in metas[o].parameters()) < 10**9]
    assert {metas[o].config.model_type for o in accepted} == {metas[o].config.model_type for o in built}
    for option in built:
        cfg = causal(f"model={option}", "max_length=16")
        job = build_job(cfg, Path(tempfile.mkdtemp()), [], process_state().device, True)
        assert not later_token_changes_earlier_outputs(job.model), option
    # the property fails where it should: the same BERT without is_decoder sees the future
    from transformers import AutoModelForCausalLM

    cfg = causal("model=tiny")
    config = build_config(cfg.model, None, job.tokenizer)
    assert config.is_decoder is False
    encoder = AutoModelForCausalLM.from_config(config)
    assert later_token_changes_earlier_outputs(encoder)
    assert sees_later_tokens(encoder)


@pytest.mark.slow
def test_a_folder_with_random_init_builds_the_folder_and_estimate_agrees(tmp_path):
    """model.name_or_path=<a folder> model.init=random builds the folder's own config (not the
    default model's architecture node), in a run and in `effitrain estimate` alike."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=30522, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    folder = tmp_path / "my-llama-config"
    config.save_pretrained(folder)
    overrides = ["task=causal_lm", "data=synthetic", f"model.name_or_path={folder}", "model.init=random",
                 "max_length=32", "max_steps=1", "logger=none", "progress_bar=false"]  # fmt: skip
    summary = run_job(tmp_path / "run", *overrides, tiny=False)
    assert summary["status"] == "ok", summary["error"]
    # 3 layers of width 24: embedding and output matrices 2 x 30522 x 24, each layer 4 x 24^2 + 3 x 24 x 40 + 2 x 24
    layer = 4 * 24 * 24 + 3 * 24 * 40 + 2 * 24
    assert summary["params/total"] == 2 * 30522 * 24 + 3 * layer + 24
    estimate = subprocess.run([sys.executable, "-m", "effitrain.cli", "estimate", "--json", *overrides[:-2]],
                              capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    rows = json.loads(estimate.stdout)["optimizers"]
    assert {row["params"] for row in rows.values()} == {summary["params/total"]}
    # architecture keys with a folder whose config.json decides are refused, not ignored
    with pytest.raises(
        ConfigError, match=r"^model.architecture.hidden_size=64 is invalid: .* holds a config.json"
    ):
        load([*overrides, "model.architecture.hidden_size=64"])


@pytest.mark.slow
def test_estimate_and_run_build_the_same_random_model_offline(tmp_path):
    """distilbert_base_cased with model.init=random offline: the run sizes the embedding to the
    tokenizer it uses (MiniLM's, 30,522), and so does `effitrain estimate`."""
    overrides = ["model=distilbert_base_cased", "model.init=random", "data=synthetic", "max_steps=1",
                 "max_length=16", "data.num_eval=8", "logger=none", "progress_bar=false"]  # fmt: skip
    summary = run_job(tmp_path, *overrides, tiny=False)
    assert summary["status"] == "ok", summary["error"]
    assert summary["model/vocab_size"] == 30522
    estimate = subprocess.run([sys.executable, "-m", "effitrain.cli", "estimate", "--json", *overrides],
                              capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    rows = json.loads(estimate.stdout)["optimizers"].values()
    assert {(row["vocab_size"], row["params"]) for row in rows} == {(30522, summary["params/total"])}
