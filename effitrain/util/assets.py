"""Offline assets: files shipped inside PyPI packages, located without importing the package."""

from __future__ import annotations

import functools
import importlib.util
import logging
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


log = logging.getLogger(__name__)


@functools.cache
def hub_unreachable() -> bool:
    """No route to the model hub: one connection attempt, name lookup included, given 2 s per
    process (skipped behind a proxy; True under ``HF_HUB_OFFLINE``). Then configs, tokenizers and
    weights come from the local cache only, instead of waiting out the hub client's retries
    (about 25 s per file)."""
    import socket
    import threading
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    endpoint = urllib.parse.urlparse(constants.ENDPOINT)
    proxies = urllib.request.getproxies()
    if proxies.get(endpoint.scheme) or proxies.get("all"):
        return False
    done, answered = threading.Event(), []

    def connect():
        try:
            port = endpoint.port or {"http": 80}.get(endpoint.scheme, 443)
            socket.create_connection((endpoint.hostname, port), timeout=2).close()
            answered.append(True)
        except (OSError, ValueError):
            pass
        done.set()

    # a thread, so that a name lookup that hangs (no resolver) is bounded too
    threading.Thread(target=connect, daemon=True, name="effitrain-hub-probe").start()
    if done.wait(2.0) and answered:
        return False
    log.warning("the hub at %s did not answer: configs, tokenizers and weights from the local cache only",
                constants.ENDPOINT)  # fmt: skip
    return True
