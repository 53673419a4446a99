"""The architecture contract of pyproject.toml (layers import downward, no cycles), as CI runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.run import REPO

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"  # import-linter, a dev dependency


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``effitrain`` package found in ``root``, with ``root``'s pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_package_keeps_its_layers_and_has_no_import_cycle():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_an_upward_import_and_a_cycle_break_the_contract(tmp_path):
    """The contract bites: the errors leaf importing the run lifecycle is reported, by module and line."""
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    shutil.copytree(REPO / "effitrain", tmp_path / "effitrain", ignore=shutil.ignore_patterns("__pycache__"))
    errors = tmp_path / "effitrain" / "config" / "errors.py"
    errors.write_text(
        errors.read_text() + "\n\ndef _upward():\n    from effitrain.run.recipe import run  # noqa\n"
    )
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout[-4000:]
    assert "Contracts: 0 kept, 2 broken." in result.stdout
    assert "effitrain.config.errors -> effitrain.run.recipe" in result.stdout
