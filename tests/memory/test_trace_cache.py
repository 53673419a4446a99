"""The disk cache of traces (effitrain.memory.trace_cache): a hit gives the bytes a trace gives, a
changed key misses, and an entry that is corrupt or another key's is traced again and rewritten."""

from __future__ import annotations

import json

import pytest

from effitrain.commands.estimate import meta_model, replay_shapes
from effitrain.memory import trace_cache
from effitrain.memory.replay import trace_run
from effitrain.memory.trace_cache import CACHED, TRACED_ALONE, TRACED_SHARED, traces_of
from tests.helpers.run import compose

OVERRIDES = ["model=tiny", "max_length=16", "eval_batch_size=2", "model.architecture.num_hidden_layers=1"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EFFITRAIN_CACHE_DIR", str(tmp_path))
    return tmp_path / "traces"


def traced(*overrides, cache=True, share=True):
    cfg = compose(*OVERRIDES, *overrides)
    model = meta_model(cfg)
    batches, evaluation = replay_shapes(cfg, model)
    optimizers = {name: compose(*OVERRIDES, *overrides, f"optimizer={name}").optimizer
                  for name in ("adamw", "lion")}  # fmt: skip
    return traces_of(model.config, optimizers, cfg, batches, evaluation, "cpu", cache, share)


def test_a_second_call_reads_what_the_first_traced_without_tracing(cache, monkeypatch):
    first, how = traced()
    assert how == {"adamw": TRACED_SHARED, "lion": TRACED_SHARED}
    assert len(list(cache.glob("*.json"))) == 2  # one entry per optimizer

    def no_trace(*args):
        raise AssertionError("traced although cached")

    import effitrain.memory.shared_traces

    monkeypatch.setattr(effitrain.memory.shared_traces, "trace_runs", no_trace)
    again, how = traced()
    assert how == {"adamw": CACHED, "lion": CACHED}
    assert again == first
    assert [list(t.phases) for t in again.values()] == [["first_step", "later_step", "eval"]] * 2
    cfg = compose(*OVERRIDES, "optimizer=adamw")
    model = meta_model(cfg)
    batches, evaluation = replay_shapes(cfg, model)
    assert again["adamw"] == trace_run(model.config, cfg.optimizer, cfg, batches, "cpu", evaluation)


def test_a_changed_precision_or_library_version_misses(cache, monkeypatch):
    traced()
    _, how = traced("precision=bf16")
    assert set(how.values()) == {TRACED_SHARED}
    versions = {**trace_cache.library_versions(), "torch": "0.0.1"}
    monkeypatch.setattr(trace_cache, "library_versions", lambda: versions)
    _, how = traced()
    assert set(how.values()) == {TRACED_SHARED}
    assert len(list(cache.glob("*.json"))) == 6


def test_a_corrupt_or_foreign_entry_is_traced_again_and_rewritten(cache):
    first, _ = traced()
    entries = {json.loads(p.read_text())["key"]["optimizer"]["_target_"]: p for p in cache.glob("*.json")}
    adamw, lion = entries["torch.optim.AdamW"], entries["lion_pytorch.Lion"]
    lion_entry = lion.read_text()
    adamw.write_text(lion_entry)  # another key's entry under adamw's name
    lion.write_text(lion_entry[: len(lion_entry) // 2])  # cut short
    again, how = traced()
    assert how == {"adamw": TRACED_SHARED, "lion": TRACED_SHARED}
    assert again == first
    assert json.loads(lion.read_text())["phases"] == first["lion"].phases
    assert json.loads(adamw.read_text())["key"]["optimizer"]["_target_"] == "torch.optim.AdamW"


def test_no_cache_neither_reads_nor_writes_and_no_share_traces_each_alone(cache):
    shared, how = traced(cache=False)
    assert not cache.exists() and set(how.values()) == {TRACED_SHARED}
    alone, how = traced(cache=False, share=False)
    assert how == {"adamw": TRACED_ALONE, "lion": TRACED_ALONE}
    assert alone == shared
