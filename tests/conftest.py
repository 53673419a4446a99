"""Fixtures every test gets: offline, private caches, fresh compile caches. Helpers live in tests/helpers/."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest


def pytest_configure(config):
    """Workers of one thread each: on tiny models two single-thread workers beat one two-thread
    process, and subprocesses (train.py, torchrun) inherit the setting."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items):
    """The slow tests first, each group in its collected order: the two workers then end on short
    tests, not one of them on a minute-long run while the other has nothing left (xdist hands out
    single tests in this order, after the modules it keeps whole: tests/helpers/scheduling.py)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_collection_finish(session):
    """What collecting imported (torch, transformers, every test module: most of a process's objects,
    held to its end) is frozen out of the garbage collector's sight, so that neither its full
    collections during the tests nor the process's exit walk them (effitrain.util.process_exit)."""
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under --dist load (the default), the modules whose module fixture makes real runs go whole to
    one worker (tests/helpers/scheduling.py); another --dist is left as asked."""
    if config.getvalue("dist") != "load":
        return None
    from tests.helpers.scheduling import SharedRunsScheduling

    return SharedRunsScheduling(config, log)


@pytest.fixture(autouse=True, scope="session")
def _offline_cache(tmp_path_factory):
    """No hub, no W&B server, and a tokenization cache private to the test session."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["WANDB_MODE"] = "offline"
    os.environ["EFFITRAIN_CACHE_DIR"] = str(tmp_path_factory.mktemp("token-cache"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def csv_files(tmp_path_factory) -> Path:
    """The CSV files the bad-input table (tests/helpers/bad_inputs.py) names as {CSV}/<name>."""
    folder = tmp_path_factory.mktemp("csv")
    (folder / "train.csv").write_text("text,label\ngood,1\nbad,0\nfine,1\nawful,0\n")
    (folder / "test.csv").write_text("text,label\nokay,1\nworse,0\n")
    (folder / "other_columns.csv").write_text("body,label\nokay,1\n")
    (folder / "header_only.csv").write_text("text,label\n")
    (folder / "bad_label.csv").write_text("text,label\nokay,1\nunlabeled,-1\n")
    (folder / "text_only.csv").write_text("text\nthe cat sat on the mat\na dog ran\nthe end\n")
    (folder / "other_labels.csv").write_text("text,label\nokay,yes\nworse,no\n")  # none of train's 0/1
    (folder / "empty_text.csv").write_text("text,label\ngood,1\n,0\nbad,0\n")
    (folder / "names.csv").write_text("text,label\ngood,pos\nbad,neg\n")
    (folder / "other_names.csv").write_text("text,label\nokay,good\nworse,bad\n")
    (folder / "new_classes.csv").write_text("text,label\nokay,2\nworse,3\n")  # classes train lacks
    (folder / "half_label.csv").write_text("text,label\ngood,1\nbad,0\nso-so,0.5\n")  # 0.5: not a class id
    (folder / "id_or_name.csv").write_text("text,label\ngood,1\nbad,0\nso-so,x\n")
    (folder / "one_class.csv").write_text("text,label\ngood,1\nfine,1\n")
    return folder


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each job of a real sweep is its own process; tests share one, where torch.compile's caches
    (and its per-function recompile limit) would carry one test's compilations into the next."""
    yield
    import torch._dynamo

    torch._dynamo.reset()
