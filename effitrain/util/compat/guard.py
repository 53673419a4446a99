"""The version guard every private API of effitrain/util/compat goes through.

An underscore name is no promise: any release may rename or drop it. Each entry of compat is used
only on releases below ``CHECKED_BELOW`` (pyproject.toml's upper bounds, the releases it was
checked on) and only when it is there; otherwise the entry's fallback says what happens.
"""

from __future__ import annotations

import functools
import logging
import re
from importlib.metadata import version

log = logging.getLogger("effitrain.util.compat")

# The first release of each library not checked here: pyproject.toml's upper bound (torchao's in
# its extra). Raising a bound there means checking this library's entries (tests/util/compat insists).
CHECKED_BELOW = {
    "torch": "2.15",
    "transformers": "6",
    "accelerate": "2",
    "datasets": "6",
    "peft": "1",
    "omegaconf": "2.4",
    "hydra-core": "1.4",
    "apollo-torch": "2",
    "torchao": "0.19",
}


def checked(library: str) -> bool:
    """The installed ``library`` is a release the private APIs of compat were checked on."""
    return _release(_installed(library)) < _release(CHECKED_BELOW[library])


@functools.cache
def _installed(library: str) -> str:
    """The installed release of ``library`` (read once: a lookup in the installed metadata costs
    milliseconds, and memory counting asks for every tensor it meets)."""
    return version(library)


def _release(text: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> (2, 13, 0): the release numbers, without local or pre-release parts."""
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", text).group().split("."))


def private(library: str, owner, name: str):
    """``owner.name`` when ``library`` is a checked release and has it; else None (the caller's fallback)."""
    if not checked(library):
        log.warning(
            "%s %s is newer than effitrain checked: not using its %s", library, version(library), name
        )
        return None
    return getattr(owner, name, None)


def missing(library: str, name: str) -> RuntimeError:
    """The error of an entry with no fallback: the library, its release, the API and what to install."""
    return RuntimeError(
        f"{library} {version(library)} has no {name}, a private API effitrain needs: "
        f"install {library}<{CHECKED_BELOW[library]} (see effitrain/util/compat)"
    )
