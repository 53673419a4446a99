"""The architecture contract of pyproject.toml (layers import downward, compare without torch, no
cycles), as CI runs it."""

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
    assert "Contracts: 3 kept, 0 broken." in result.stdout


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
    assert "Contracts: 0 kept, 3 broken." in result.stdout  # compare imports errors: torch too
    assert "effitrain.config.errors -> effitrain.run.recipe" in result.stdout


COMPARE_MODULES = [
    "effitrain.compare",
    "effitrain.compare.load",
    "effitrain.compare.combinations",
    "effitrain.compare.learning",
    "effitrain.compare.verdict",
    "effitrain.compare.table",
    "effitrain.compare.render",
    "effitrain.compare.page",
    "effitrain.compare.labels",
    "effitrain.compare.axes",
    "effitrain.compare.plots",
    "effitrain.compare.pareto",
    "effitrain.compare.wandb",
]


def test_compare_imports_no_torch():
    """The table, verdict and plots read the summary schema (config/summary_schema), not the torch
    side that writes it: importing every compare module leaves torch out of the process."""
    code = f"import sys; import {', '.join(COMPARE_MODULES)}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_compare_importing_torch_breaks_its_contract(tmp_path):
    """The forbidden contract bites: compare reading the memory categories from memory/replay (which
    imports torch) instead of the summary schema is reported, with the chain that reaches torch."""
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    shutil.copytree(REPO / "effitrain", tmp_path / "effitrain", ignore=shutil.ignore_patterns("__pycache__"))
    plots = tmp_path / "effitrain" / "compare" / "plots.py"
    plots.write_text(
        plots.read_text()
        + "\n\ndef _torch_side():\n    from effitrain.memory.replay import CATEGORIES  # noqa\n"
    )
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout[-4000:]
    assert "Contracts: 2 kept, 1 broken." in result.stdout
    assert "effitrain.compare is not allowed to import torch" in result.stdout
    assert "effitrain.compare.plots -> effitrain.memory.replay" in result.stdout
