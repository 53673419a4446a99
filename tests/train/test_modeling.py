"""Model and tokenizer as the run builds them."""

from __future__ import annotations

from transformers import BertConfig

from tests.helpers.run import run_job


def test_a_tokenizer_folder_without_a_vocabulary_is_refused_in_one_line(tmp_path):
    """A folder holding a config but no tokenizer files loads a tokenizer of its 5 special tokens,
    every word [UNK]: refused, naming the key, before any model is built."""
    folder = tmp_path / "config-only"
    BertConfig(vocab_size=100).save_pretrained(folder)
    summary = run_job(tmp_path / "run", f"model.tokenizer={folder}", "max_steps=1")
    assert (summary["status"], summary["error_type"]) == ("failed", "config")
    assert summary["error"] == (
        f"model.tokenizer={str(folder)!r} is invalid: it holds no vocabulary (the tokenizer knows only "
        "its 5 special tokens): give a folder with the tokenizer's files"
    )
    assert "params/total" not in summary  # no model was built
