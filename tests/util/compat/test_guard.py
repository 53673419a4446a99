"""The version guard of effitrain/util/compat: every entry used only on the releases it was checked
on, and pyproject.toml admitting no other."""

from __future__ import annotations

import re

import torch

from effitrain.util import compat
from effitrain.util.compat import guard
from tests.helpers.run import REPO


def test_pyproject_admits_only_releases_compat_was_checked_on():
    """Raising an upper bound in pyproject.toml (torchao's in its extra) means rechecking that
    library's private APIs."""
    from importlib.metadata import PackageNotFoundError, version

    # the project's requirements, "name>=low,<high" (tomllib is not in Python 3.10)
    bounds = dict(
        re.findall(r'"([A-Za-z0-9_.-]+)>=[^",]+,<([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    )
    assert bounds["torch"] == "2.15" and bounds["transformers"] == "6"  # read as written
    assert bounds["omegaconf"] == "2.4" and bounds["torchao"] == "0.19"
    for library, below in compat.CHECKED_BELOW.items():
        assert bounds.get(library) == below, (
            f"pyproject.toml: {library}<{bounds.get(library)}; compat: <{below}"
        )
        try:
            version(library)
        except PackageNotFoundError:  # an extra not installed here (torchao): its entries' tests skip
            continue
        assert compat.checked(library), f"the installed {library} is outside compat.CHECKED_BELOW"


def test_the_guard_refuses_a_release_beyond_the_checked_ones(monkeypatch):
    monkeypatch.setitem(compat.CHECKED_BELOW, "torch", "2.0")
    assert not compat.checked("torch")
    assert compat.private("torch", torch, "_C") is None  # there, but not used on an unchecked torch
    assert compat.adam_step_dtype() == torch.float32  # the fallback
    assert guard._release("2.13.0+cpu") == (2, 13, 0) and guard._release("6") == (6,)
    error = compat.missing("torch", "torch._C._gone")
    assert str(error).startswith("torch 2.13") and "has no torch._C._gone" in str(error)
    assert "install torch<2.0" in str(error)
