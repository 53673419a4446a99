"""Atomic writes: a file or a folder appears whole under its name, or not at all.

It is written under a hidden temporary name beside its target, flushed to disk (fsync), then
renamed in one step, and the folder holding it is fsynced so that the rename survives a crash too.
One helper for every result effitrain writes: ``summary.json`` and ``metrics.jsonl``
(:mod:`effitrain.run.results`), a checkpoint's folder (:mod:`effitrain.train.checkpoint`) and the
tokenized data's cache entry (:mod:`effitrain.train.data`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import uuid
from pathlib import Path


def sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks: what a checkpoint's and a cache entry's
    manifest records, and what is checked when they are read back."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush ``path`` to disk: a file's content, or a folder's entries."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, target: Path, replace_folder: bool = False) -> None:
    """Make ``tmp`` (a file, or a folder of files, in ``target``'s folder) ``target`` in one rename,
    after flushing its content to disk. A file replaces an existing ``target``; a folder replaces an
    existing one only with ``replace_folder`` (removed first), else the rename fails with OSError
    and the existing folder stays."""
    tmp, target = Path(tmp), Path(target)
    if tmp.is_dir():
        for path in tmp.rglob("*"):
            if path.is_file():
                fsync_path(path)
    fsync_path(tmp)
    if target.is_symlink():  # planted after the run's folder check: neither replaced nor followed
        raise OSError(errno.ELOOP, "a symbolic link the run did not make is there", str(target))
    if replace_folder and target.is_dir():
        shutil.rmtree(target)
    os.replace(tmp, target)
    fsync_path(target.parent)


@contextlib.contextmanager
def atomic_path(target: Path):
    """A temporary path beside ``target`` to write (a file) or fill (a folder): published as
    ``target`` when the block ends cleanly (:func:`publish`), removed when anything fails."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    try:
        yield tmp
        publish(tmp, target)
    except BaseException:
        remove(tmp)
        raise


def remove(path: Path) -> None:
    """Delete a file or a folder, if there."""
    if Path(path).is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically (its folder made if missing). The file gets the mode any
    other new file gets (0666 less the umask), readable by colleagues on shared storage."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as handle:
            handle.write(data)


PROBE_BYTES = 4096  # one file-system block: what a full disk or a spent quota refuses


def probe_write(folder: Path) -> None:
    """Write and flush a nameless block in ``folder``, then drop it: raises OSError (no space left,
    quota exceeded, read-only) where results could not be written. An empty file would not show a
    full disk: it takes no block."""
    with tempfile.TemporaryFile(dir=folder, prefix=".effitrain-write-probe-") as probe:
        probe.write(bytes(PROBE_BYTES))
        probe.flush()
        os.fsync(probe.fileno())
