"""``python train.py`` as a user types it: bad input fails fast with one line, and nothing is marked ok."""

from __future__ import annotations

import json

import pytest

from tests.bad_inputs import DATA, PARSE, VALUES, fill
from tests.conftest import TINY, train_py


def _run_dir(tmp_path):
    return f"hydra.run.dir={tmp_path}/run"


def _summaries(tmp_path):
    return [json.loads(p.read_text()) for p in tmp_path.rglob("summary.json")]


# A few rows of the bad-input table, as a user types them: grammar, a key, a value, the data.
def _rows(table, *overrides: str) -> list:
    return [row for row in table if any(o in row[0] for o in overrides)]


ROWS = (
    _rows(PARSE, "optimizer=sgd", "lr=1e-3", "micro_batchsize=4", "seed=x")
    + _rows(VALUES, "optimizer.betas=[0.9]")
    + [row for row in VALUES if "missing.csv" in row[1]]
    + [DATA[1]]
)
# the grammar row in the fast selection, all of them in the full suite
SUBPROCESS_ROWS = [
    row if i == 2 else pytest.param(*row, marks=pytest.mark.slow) for i, row in enumerate(ROWS)
]


@pytest.mark.parametrize("overrides, message", SUBPROCESS_ROWS)
def test_bad_input_is_one_line_nonzero_and_never_ok(tmp_path, csv_files, overrides, message):
    overrides, message = fill(overrides, message, csv_files)
    result = train_py(*TINY, *overrides, _run_dir(tmp_path))
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("effitrain: error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in result.stderr
    assert all(summary["status"] != "ok" for summary in _summaries(tmp_path))
