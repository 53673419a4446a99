"""Offline assets: files shipped inside PyPI packages, located without importing the package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from omegaconf import OmegaConf


def package_file(package: str, relative: str = "") -> str:
    """Path of ``relative`` inside the installed ``package``.

    ``find_spec`` on a top-level package reads only its location, so a package with a heavy
    ``__init__`` (or heavy declared dependencies we never install) is not imported.

    Raises:
        FileNotFoundError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed (pip install {package.replace('_', '-')}; "
            "see the README's first command)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise FileNotFoundError(f"{relative!r} not found inside package {package!r} at {path}")
    return str(path)


def register_resolvers() -> None:
    """``${effitrain.asset:package,relative/path}`` in configs."""
    if not OmegaConf.has_resolver("effitrain.asset"):
        OmegaConf.register_new_resolver("effitrain.asset", package_file)
