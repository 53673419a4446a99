"""No write through a link the run did not make: a planted link is found wherever it lies in a folder
(W&B's own links excepted), and an append opened without following links refuses one."""

from __future__ import annotations

import errno
import os

import pytest

from effitrain.util.links import WANDB, link_refusal, open_no_follow, planted_link


def test_a_link_is_found_at_any_depth_and_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "inner").symlink_to(tmp_path)  # a link inside the target: never reached
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    assert planted_link(run) is None
    (run / "checkpoints" / "step-00000002").symlink_to(victim)
    assert planted_link(run) == run / "checkpoints" / "step-00000002"
    assert link_refusal("hydra.run.dir", run) == (
        f"hydra.run.dir={str(run)!r} is invalid: {run}/checkpoints/step-00000002 is a symbolic link "
        f"(to {victim}), and effitrain writes through no link it did not make: remove the link, or give "
        "another folder"
    )


def test_w_and_b_s_own_folder_is_not_walked_but_a_link_in_its_place_is_planted(tmp_path):
    wandb = tmp_path / "wandb"
    (wandb / "offline-run-1" / "logs").mkdir(parents=True)
    (wandb / "latest-run").symlink_to("offline-run-1")
    (wandb / "debug.log").symlink_to(wandb / "offline-run-1" / "logs" / "debug.log")
    (wandb / "offline-run-1" / "logs" / "debug-core.log").symlink_to("/root/.cache/wandb/logs/core-debug.log")
    assert planted_link(tmp_path) is None  # W&B links its logs inside and outside its folder itself
    (tmp_path / "sweep-job").mkdir()
    (tmp_path / "sweep-job" / WANDB).symlink_to("/etc")  # a job's own wandb/ is walked: not at the top
    assert planted_link(tmp_path) == tmp_path / "sweep-job" / WANDB
    other = tmp_path / "other"
    other.mkdir()
    (other / WANDB).symlink_to(wandb)  # the folder itself a link: planted
    assert planted_link(other) == other / WANDB


@pytest.mark.parametrize("mode", ["a", "wb"])
def test_an_append_or_a_write_through_a_link_fails_and_the_target_keeps_its_bytes(tmp_path, mode):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "job.log").symlink_to(victim)
    with pytest.raises(OSError) as raised:
        open_no_follow(tmp_path / "job.log", mode)
    assert raised.value.errno == errno.ELOOP
    assert victim.read_text() == "precious\n"
    with open_no_follow(tmp_path / "fresh.log", mode) as handle:  # a plain file is written as open() would
        handle.write(b"x" if "b" in mode else "x")
    with open_no_follow(tmp_path / "fresh.log", mode) as handle:
        handle.write(b"y" if "b" in mode else "y")
    assert (tmp_path / "fresh.log").read_text() == ("xy" if mode == "a" else "y")
    assert not os.path.islink(tmp_path / "fresh.log")
