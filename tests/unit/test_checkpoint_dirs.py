"""Checkpoint folder conventions: atomic visibility, the `latest` pointer, keep_last pruning, newest-complete lookup."""

from __future__ import annotations

import pytest

from hpc_tools.checkpoints.dirs import LATEST, META, CheckpointDirs, dir_name, parse_step, resume_source
from hpc_tools.errors import UserError


def save(dirs: CheckpointDirs, step: int, payload: str = "x", **meta) -> None:
    path = dirs.begin(step)
    (path / "payload.txt").write_text(payload)
    dirs.commit(step, meta=meta)


def test_names_round_trip():
    assert dir_name(10) == "iter_0000010"
    assert parse_step("iter_0000010") == 10
    assert parse_step("iter_12345678") == 12345678
    for bad in ("iter_0000010.partial", "latest", "iter_10", "global_step10"):
        assert parse_step(bad) is None
    with pytest.raises(ValueError):
        dir_name(-1)


def test_empty_root_has_nothing(tmp_path):
    dirs = CheckpointDirs(tmp_path / "missing")
    assert dirs.newest() is None and dirs.complete() == [] and dirs.newest_step() is None


def test_commit_makes_folder_visible_and_points_latest(tmp_path):
    dirs = CheckpointDirs(tmp_path)
    partial = dirs.begin(5)
    (partial / "payload.txt").write_text("five")
    assert dirs.newest() is None, "a save in progress must not be visible"
    final = dirs.commit(5, meta={"layout": "TP2xPP2"})
    assert final == tmp_path / "iter_0000005" and not partial.exists()
    assert (tmp_path / LATEST).read_text().strip() == "iter_0000005"
    assert dirs.newest() == final and dirs.newest_step() == 5
    meta = CheckpointDirs.read_meta(final)
    assert meta["step"] == 5 and meta["layout"] == "TP2xPP2"


def test_interrupted_save_keeps_last_good(tmp_path):
    dirs = CheckpointDirs(tmp_path)
    save(dirs, 10, "ten")
    partial = dirs.begin(20)  # killed here: files half written, never committed
    (partial / "payload.txt").write_text("half")
    assert dirs.newest() == tmp_path / "iter_0000010"
    # the next save of the same step starts clean
    again = dirs.begin(20)
    assert list(again.iterdir()) == []


def test_the_same_step_saved_again_replaces_its_folder_whole(tmp_path):
    """An interval save, then a stop signal's save of the same step: the second folder replaces the first whole (no
    file of the first left in it), and nothing is left beside it, not even a folder set aside by an earlier save
    killed between its two renames."""
    dirs = CheckpointDirs(tmp_path)
    (dirs.begin(10) / "interval.txt").write_text("first")
    dirs.commit(10)
    stale = tmp_path / "iter_0000010.replaced"
    stale.mkdir()
    (stale / "old.txt").write_text("killed between the renames")
    (dirs.begin(10) / "signal.txt").write_text("second")
    final = dirs.commit(10, meta={"why": "signal"})
    assert sorted(p.name for p in final.iterdir()) == [META, "signal.txt"]
    assert CheckpointDirs.read_meta(final)["why"] == "signal"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000010", LATEST]


def test_keep_last_prunes_oldest_and_stale_partials(tmp_path):
    dirs = CheckpointDirs(tmp_path, keep_last=2)
    dirs.begin(3)  # a stale partial from a killed run, older than what follows
    for step in (10, 20, 30):
        save(dirs, step)
    assert [s for s, _ in dirs.complete()] == [20, 30]
    assert not dirs.partial_path(3).exists()


def test_folder_without_meta_is_not_complete(tmp_path):
    dirs = CheckpointDirs(tmp_path)
    save(dirs, 10)
    (tmp_path / "iter_0000099").mkdir()  # e.g. copied by hand, or written by a tool that skipped commit
    assert dirs.newest_step() == 10


def test_stale_pointer_loses_to_newer_complete_folder(tmp_path):
    dirs = CheckpointDirs(tmp_path, keep_last=5)
    save(dirs, 10)
    save(dirs, 20)
    (tmp_path / LATEST).write_text("iter_0000010\n")  # killed between the rename and the pointer write
    assert dirs.newest_step() == 20
    (tmp_path / LATEST).write_text("../elsewhere\n")
    assert dirs.newest_step() == 20


def test_saving_the_same_step_twice_replaces_it(tmp_path):
    dirs = CheckpointDirs(tmp_path)
    save(dirs, 10, "first")
    save(dirs, 10, "second")
    assert (dirs.newest() / "payload.txt").read_text() == "second"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("iter_")] == ["iter_0000010"]


def test_commit_without_begin_fails(tmp_path):
    with pytest.raises(FileNotFoundError, match="begin"):
        CheckpointDirs(tmp_path).commit(7)


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointDirs(tmp_path, keep_last=0)
    assert META.endswith(".json")


def test_resume_source_prefers_the_runs_own_newest_then_load_path(tmp_path):
    own, other = CheckpointDirs(tmp_path / "own"), CheckpointDirs(tmp_path / "other")
    save(other, 7)
    save(other, 9)
    load = str(tmp_path / "other")
    assert resume_source(own, resume=True, load_path=None) is None, "fresh start"
    assert resume_source(own, resume=True, load_path=load) == other.final_path(9), "a root: its newest"
    assert resume_source(own, resume=True, load_path=str(other.final_path(7))) == other.final_path(7)
    save(own, 3)
    assert resume_source(own, resume=True, load_path=load) == own.final_path(3), "a requeued run continues itself"
    assert resume_source(own, resume=False, load_path=load) == other.final_path(9)
    assert resume_source(own, resume=False, load_path=None) is None


def test_resume_source_rejects_a_load_path_without_a_complete_checkpoint(tmp_path):
    dirs = CheckpointDirs(tmp_path / "half")
    dirs.begin(5)  # never committed
    for bad in (tmp_path / "half", dirs.partial_path(5), tmp_path / "missing"):
        with pytest.raises(UserError, match=rf"checkpoint.load_path={bad} holds no complete checkpoint"):
            resume_source(CheckpointDirs(tmp_path / "own"), resume=True, load_path=str(bad))
