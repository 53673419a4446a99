"""No write or delete through a symbolic link the run did not make.

effitrain makes no links. Anyone who can write a run's or a sweep's folder could plant one (``job.log``
to a victim file, ``checkpoints`` to another run's folder, ``.hydra`` elsewhere), and every write or
prune there would land on the target. So a folder holding a link is refused before anything is written
(:func:`planted_link`, asked by the folder checks), and the files appended to while a run goes on are
opened without following one (:func:`open_no_follow`), so a link planted meanwhile fails that write.
"""

from __future__ import annotations

import os
from pathlib import Path

WANDB = "wandb"  # W&B's own folder: W&B writes there, and links its logs inside and outside it


def planted_link(folder: Path) -> Path | None:
    """The first symbolic link inside ``folder`` (walked without following links), or None. W&B's own
    folder (``wandb/``, whose links W&B makes itself: ``latest-run``, its debug logs) is not walked;
    ``folder`` itself may be one (a user's choice of where results go)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    for top, dirs, files in os.walk(folder):
        here = Path(top)
        if here == folder and WANDB in dirs and not (here / WANDB).is_symlink():
            dirs.remove(WANDB)
        for name in sorted(dirs + files):
            path = here / name
            if path.is_symlink():
                return path
        dirs[:] = [name for name in dirs if not (here / name).is_symlink()]
    return None


def link_refusal(key: str, folder: Path) -> str | None:
    """The one line refusing ``folder`` (the value of ``key``) when it holds a planted link, else None."""
    link = planted_link(folder)
    if link is None:
        return None
    return (
        f"{key}={str(folder)!r} is invalid: {link} is a symbolic link (to {os.readlink(link)}), and effitrain "
        "writes through no link it did not make: remove the link, or give another folder"
    )


def open_no_follow(path: Path, mode: str = "a"):
    """``open(path, mode)`` for writing (``a``, ``w``, ``ab``, ``wb``) that fails with OSError (ELOOP)
    where ``path`` is a symbolic link, instead of writing to its target."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o666), mode)
