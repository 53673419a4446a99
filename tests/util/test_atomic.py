"""The one atomic-write helper: whole or nothing, flushed before the rename, the rename flushed after."""

from __future__ import annotations

import os

import pytest

from effitrain.util import atomic


def test_a_file_is_replaced_whole_and_nothing_else_is_left(tmp_path):
    path = tmp_path / "sub" / "summary.json"
    atomic.write_atomic(path, '{"a": 1}\n')
    atomic.write_atomic(path, b'{"a": 2}\n')
    assert path.read_text() == '{"a": 2}\n'
    assert sorted(p.name for p in path.parent.iterdir()) == ["summary.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_partial(tmp_path):
    path = tmp_path / "result.pkl"
    atomic.write_atomic(path, b"old")
    with pytest.raises(OSError, match="No space"):
        with atomic.atomic_path(path) as tmp:
            tmp.write_bytes(b"half")
            raise OSError(28, "No space left on device")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["result.pkl"]


def test_content_is_flushed_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(atomic, "fsync_path", lambda p: events.append(("fsync", p.name)))
    real_replace = os.replace
    monkeypatch.setattr(
        atomic.os, "replace", lambda a, b: (events.append(("rename", b.name)), real_replace(a, b))
    )
    target = tmp_path / "step-00000002"
    with atomic.atomic_path(target) as tmp:
        (tmp / "inner").mkdir(parents=True)
        (tmp / "inner" / "model.safetensors").write_bytes(b"w" * 10)
    names = [name for _, name in events]
    assert events[-2:] == [("rename", "step-00000002"), ("fsync", tmp_path.name)]
    assert names.index("model.safetensors") < names.index(tmp.name) < names.index("step-00000002")
    assert (target / "inner" / "model.safetensors").read_bytes() == b"w" * 10


def test_a_folder_replaces_an_existing_one_only_when_asked(tmp_path):
    target = tmp_path / "cache"
    target.mkdir()
    (target / "first").write_text("first writer")
    second = tmp_path / ".cache.partial"
    second.mkdir()
    (second / "second").write_text("second writer")
    with pytest.raises(OSError):  # a cache entry another process published stays
        atomic.publish(second, target)
    assert [p.name for p in target.iterdir()] == ["first"]
    atomic.publish(second, target, replace_folder=True)  # a checkpoint of the same step is replaced
    assert [p.name for p in target.iterdir()] == ["second"] and not second.exists()
