"""The run folder's lock (results.folder_lock): held while a run or a sweep's job runs, no file left
behind once it is let go, and never held by two processes at once, though the file is removed and
made anew between holders."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from effitrain.run.folder_policy import LOCK, folder_in_use, folder_lock
from tests.helpers.run import REPO

# One process of the race below: takes the folder's lock ROUNDS times (retrying while another
# holds it) and, while holding it, makes an exclusive marker file: a second holder at that moment
# could not make it, and says so. It also counts its rounds into a shared file read and rewritten
# under the lock, so a lost update shows two holders too.
LOCKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from effitrain.run.folder_policy import folder_lock

    folder, rounds = Path(sys.argv[1]), int(sys.argv[2])
    held = busy = 0
    while held < rounds:
        with folder_lock(folder) as owner:
            if owner is not None:
                busy += 1
                continue
            marker = os.open(folder / "holder", os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # raises if held twice
            count = folder / "count"
            seen = int(count.read_text()) if count.exists() else 0
            time.sleep(0.0005)
            count.write_text(str(seen + 1))
            os.close(marker)
            os.unlink(folder / "holder")
            held += 1
    print(held, busy)
    """
)


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "EFFITRAIN_FOLDER_LOCKED")}
    return dict(env, PYTHONPATH=str(REPO))


def other_process_owner(folder) -> str:
    """What folder_lock says in another process: ``None`` (it got the lock) or the holder's pid."""
    code = f"from pathlib import Path\nfrom effitrain.run.folder_policy import folder_lock\nwith folder_lock(Path({str(folder)!r})) as o: print(o)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_lock_file_is_there_while_held_and_gone_after(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("EFFITRAIN_FOLDER_LOCKED", raising=False)
    folder = tmp_path / "run"
    with folder_lock(folder) as owner:
        assert owner is None
        assert (folder / LOCK).read_text() == str(os.getpid())
        assert other_process_owner(folder) == str(os.getpid())  # a second locker: refused, told by whom
    assert os.listdir(folder) == []  # let go: nothing left
    assert other_process_owner(folder) == "None"  # and the next one gets it
    assert os.listdir(folder) == []


def test_the_in_use_probe_names_the_holder_to_rank_0_only(tmp_path, monkeypatch):
    # a data-parallel job's other ranks find their own rank 0 holding the folder: not "in use"
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("EFFITRAIN_FOLDER_LOCKED", raising=False)
    assert folder_in_use(tmp_path) is None
    with folder_lock(tmp_path) as owner:
        assert owner is None
        code = (
            f"from effitrain.run.folder_policy import folder_in_use; print(folder_in_use({str(tmp_path)!r}))"
        )
        for rank, said in (("0", str(os.getpid())), ("1", "None")):
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  env=dict(clean_env(), RANK=rank), timeout=120)  # fmt: skip
            assert (done.returncode, done.stdout.strip()) == (0, said), done.stderr
    assert folder_in_use(tmp_path) is None and os.listdir(tmp_path) == []


def test_a_stale_lock_file_of_a_dead_process_is_taken_and_removed(tmp_path, monkeypatch):
    """kill -9 leaves the file (its flock goes with the process): the next run takes it over."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("EFFITRAIN_FOLDER_LOCKED", raising=False)
    (tmp_path / LOCK).write_text("4242")
    with folder_lock(tmp_path) as owner:
        assert owner is None and (tmp_path / LOCK).read_text() == str(os.getpid())
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_concurrent_lockers_never_both_hold_the_folder(tmp_path):
    """Four processes take and let go of one folder's lock 150 times each. Each holder removes the
    file as it lets go, so a waiter often locks a file already removed while another process makes
    a new one: without the check that the locked file is still the one at the path, two processes
    hold the folder at once (the marker's O_EXCL fails, the shared count loses rounds)."""
    rounds, processes = 150, 4
    lockers = [
        subprocess.Popen([sys.executable, "-c", LOCKER, str(tmp_path), str(rounds)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=clean_env())
        for _ in range(processes)
    ]  # fmt: skip
    outputs = [locker.communicate(timeout=300) for locker in lockers]
    assert [locker.returncode for locker in lockers] == [0] * processes, [err for _, err in outputs]
    assert [int(out.split()[0]) for out, _ in outputs] == [rounds] * processes
    assert int((tmp_path / "count").read_text()) == rounds * processes  # no update lost
    assert sum(int(out.split()[1]) for out, _ in outputs) > 0  # they did contend
    assert sorted(os.listdir(tmp_path)) == ["count"]  # no lock file, no marker left
