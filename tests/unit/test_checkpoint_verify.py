"""Verified checkpoints and the non-finite guard without processes: the file lists a save records, completeness,
verification of a share, set-aside folders, the loop's fallback to the previous checkpoint, and the loop's count of
non-finite steps (the backends' fault-injection runs are in tests/integration/test_checkpoint_faults.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_tools.checkpoints import verify as cv
from hpc_tools.checkpoints.dirs import LATEST, META, SET_ASIDE_NOTE, CheckpointDirs, resume_source
from hpc_tools.train import loop
from hpc_tools.train.checkpointing.resume import CheckpointError
from hpc_tools.train.engine import NullCollector


def save(dirs: CheckpointDirs, step: int, files: dict[str, bytes] | None = None) -> Path:
    path = dirs.begin(step)
    for name, data in (files or {"model.pt": os.urandom(3000), "optim.pt": os.urandom(5000)}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return dirs.commit(step, meta={"format": "test"})


# -- recording and completeness ----------------------------------------------------------------------------------------

def test_commit_records_every_file_with_size_and_checksum(tmp_path):
    final = save(CheckpointDirs(tmp_path), 5, {"a.pt": b"x" * 10, "sub/b.pt": b"y" * 7})
    files = CheckpointDirs.read_meta(final)["files"]
    assert files["algorithm"] == "xxh3_64" and files["world_size"] == 1
    entries = files["by_rank"]["0"]
    assert set(entries) == {"a.pt", "sub/b.pt"}, "the meta file itself is not listed"
    assert entries["a.pt"]["size"] == 10 and entries["a.pt"]["xxh3_64"] == cv.file_checksum(final / "a.pt")


def test_complete_only_when_every_ranks_list_is_in_the_meta(tmp_path):
    dirs = CheckpointDirs(tmp_path)
    final = save(dirs, 5)
    meta = json.loads((final / META).read_text())
    meta["files"]["world_size"] = 2  # rank 1's list never arrived
    (final / META).write_text(json.dumps(meta))
    assert not dirs.is_complete(final) and dirs.newest() is None
    assert "lacks the file lists of ranks ['1']" in CheckpointDirs.incomplete_reason(final)
    del meta["files"]  # written by an hpc_tools before verification
    (final / META).write_text(json.dumps(meta))
    assert "holds no file lists" in CheckpointDirs.incomplete_reason(final)
    (final / META).write_text("{torn")
    assert "unreadable" in CheckpointDirs.incomplete_reason(final)
    assert [p for p, _ in dirs.incomplete()] == [final]


def test_shares_prefer_the_writer_and_balance_the_rest():
    sizes = {"__0_0.distcp": 100, "__1_0.distcp": 100, "__5_0.distcp": 40, "common.pt": 30, ".metadata": 10,
             "rng_rank00001.pt": 5}
    split = cv.shares(sizes, 2)
    assert "__0_0.distcp" in split[0] and "__1_0.distcp" in split[1] and "rng_rank00001.pt" in split[1]
    assert sorted(n for part in split for n in part) == sorted(sizes), "every file exactly once"
    assert split == cv.shares(dict(reversed(list(sizes.items()))), 2), "the same split whatever the listing order"
    loads = [sum(sizes[n] for n in part) for part in split]
    assert max(loads) - min(loads) <= 40


def test_record_share_over_ranks_covers_the_folder(tmp_path):
    for i in range(7):
        (tmp_path / f"f{i}.bin").write_bytes(os.urandom(100 * (i + 1)))
    lists = [cv.record_share(tmp_path, r, 3, checksum=True) for r in range(3)]
    assert sorted(n for entries in lists for n in entries) == sorted(f"f{i}.bin" for i in range(7))
    assert all(len(entries) >= 2 for entries in lists)


# -- verification ------------------------------------------------------------------------------------------------------

def corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "random":
        data[100:164] = os.urandom(64)
        path.write_bytes(bytes(data))
    elif how == "bitflip":
        data[17] ^= 0x04
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        path.unlink()


@pytest.mark.parametrize("how, reason", [("random", "checksum"), ("bitflip", "checksum"), ("truncate", "size"),
                                         ("missing", "missing")])
def test_verify_names_the_file_and_the_reason(tmp_path, how, reason):
    final = save(CheckpointDirs(tmp_path), 5)
    meta = CheckpointDirs.read_meta(final)
    assert cv.verify_share(final, meta, 0, 1, checksum=True).problems == []
    corrupt(final / "optim.pt", how)
    problems = [p for r in range(2) for p in cv.verify_share(final, meta, r, 2, checksum=True).problems]
    assert [(p.file, p.reason) for p in problems] == [("optim.pt", reason)]
    assert problems[0].line(final).startswith(f"{final / 'optim.pt'}: ")
    size_only = cv.verify_share(final, meta, 0, 1, checksum=False)
    assert bool(size_only.problems) == (reason != "checksum"), "sizes only: same-size corruption is not seen"
    assert size_only.bytes == 0 and not size_only.checksums


# -- set aside ---------------------------------------------------------------------------------------------------------

def test_set_aside_renames_notes_and_repoints_latest(tmp_path):
    dirs = CheckpointDirs(tmp_path, keep_last=2)
    save(dirs, 10)
    newest = save(dirs, 20)
    save(dirs, 30)
    assert [s for s, _ in dirs.complete()] == [20, 30], "keep_last=2 pruned step 10"
    moved = dirs.set_aside(dirs.final_path(30), "checksum", "optim.pt: changed")
    assert moved.name == "iter_0000030.bad-checksum" and "optim.pt: changed" in (moved / SET_ASIDE_NOTE).read_text()
    assert (tmp_path / LATEST).read_text().strip() == newest.name and dirs.newest() == newest
    save(dirs, 30)  # the run saves step 30 again, and sets it aside again
    assert dirs.set_aside(dirs.final_path(30), "size", "x").name == "iter_0000030.bad-size"
    save(dirs, 30)
    assert dirs.set_aside(dirs.final_path(30), "size", "x").name == "iter_0000030.bad-size-2"
    save(dirs, 40)
    save(dirs, 50)
    assert [p.name for p in dirs.set_aside_folders()] == ["iter_0000030.bad-checksum", "iter_0000030.bad-size",
                                                          "iter_0000030.bad-size-2"], "never pruned"
    while dirs.newest() is not None:
        dirs.set_aside(dirs.newest(), "load", "y")
    assert not (tmp_path / LATEST).exists()


def test_keep_last_never_deletes_the_verified_good_checkpoint(tmp_path):
    dirs = CheckpointDirs(tmp_path, keep_last=1)
    good = save(dirs, 10)
    dirs.mark_verified(good)  # a resume verified and loaded it
    for step in (20, 30):
        save(dirs, step)
    assert [s for s, _ in dirs.complete()] == [10, 30], "step 20 pruned, the verified one kept"
    dirs.set_aside(dirs.final_path(30), "checksum", "bad")
    assert dirs.newest() == good, "the run still has a checkpoint to fall back on"
    dirs.mark_verified(save(dirs, 40))
    save(dirs, 50)
    assert [s for s, _ in dirs.complete()] == [40, 50], "a newer verified one releases the old"


def test_resume_source_skips_failed_checkpoints(tmp_path):
    own, other = CheckpointDirs(tmp_path / "own"), CheckpointDirs(tmp_path / "other")
    save(other, 7)
    save(other, 9)
    load = str(tmp_path / "other")
    assert resume_source(own, resume=True, load_path=load, skip=[other.final_path(9)]) == other.final_path(7)
    assert resume_source(own, resume=True, load_path=load, skip=[other.final_path(7), other.final_path(9)]) is None
    assert resume_source(own, resume=True, load_path=str(other.final_path(7)), skip=[other.final_path(7)]) is None


# -- the loop: fallback and the non-finite guard -----------------------------------------------------------------------

class Ctx:
    def __init__(self, root: Path, *, iters: int = 6, interval: int | None = 2, limit: int = 2,
                 load_path: str | None = None, verify: str = "checksum"):
        self.checkpoint_dir = root / "checkpoints"
        self.recipe = SimpleNamespace(
            training=SimpleNamespace(train_iters=iters, log_interval=1, max_nonfinite_steps=limit),
            checkpoint=SimpleNamespace(interval_iters=interval, keep_last=5, resume=True, load_path=load_path,
                                       verify=verify, local_dir=None, local_interval_iters=None,
                                       async_save=False, local_replicate=True))
        self.is_rank0, self.rank, self.logged = True, 0, []

    def heartbeat(self, step):
        pass

    def agree_stop(self, final=False):
        return False

    def note_layout(self, from_iteration):  # the manifest's layouts (RankContext): no run folder here
        pass

    def finish_preempted(self, step):
        raise AssertionError("no stop in these tests")

    def info(self, msg, *args):
        self.logged.append(msg % args)


class Collector(NullCollector):
    def __init__(self):
        self.rows = []

    def end_step(self, step, **fields):
        self.rows.append((step, fields["nonfinite"], fields["skipped"]))


class Engine:
    """Writes real checkpoints (the saver commits them); ``fail_load`` names checkpoints whose load raises;
    ``nonfinite`` the steps that report a non-finite loss."""

    checkpoints = True

    def __init__(self, ctx: Ctx, *, fail_load=(), nonfinite=()):
        self.dirs = CheckpointDirs(ctx.checkpoint_dir, keep_last=5)
        self.fail_load, self.nonfinite, self.loaded, self.saved = set(fail_load), set(nonfinite), [], []

    def describe(self):
        return "fake"

    def coords(self):
        return {}

    def resume(self, source: Path) -> int:
        if source.name in self.fail_load:
            raise EOFError("Ran out of input")
        self.loaded.append(source.name)
        return int(CheckpointDirs.read_meta(source)["step"])

    def batch(self, step):
        return None

    def step(self, step, batch):
        bad = step in self.nonfinite
        return loop.StepResult(loss=float("nan") if bad else 1.0, skipped=bad or None, nonfinite=bad)

    def write_checkpoint(self, folder: Path, step: int, background: bool):
        self.saved.append(step)
        (folder / "model.pt").write_bytes(os.urandom(3000))
        (folder / "optim.pt").write_bytes(os.urandom(5000))

    def checkpoint_meta(self, step: int) -> dict:
        return {"format": "test"}

    def close(self):
        pass


def train(ctx: Ctx, engine: Engine) -> Collector:
    collector = Collector()
    loop.train(ctx, engine, collector_for=lambda c, **k: collector)
    return collector


def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(tmp_path):
    ctx = Ctx(tmp_path, iters=4)
    train(ctx, Engine(ctx))
    dirs = CheckpointDirs(ctx.checkpoint_dir)
    assert [s for s, _ in dirs.complete()] == [2, 4]
    corrupt(dirs.final_path(4) / "optim.pt", "random")
    ctx = Ctx(tmp_path, iters=6)
    engine = Engine(ctx)
    train(ctx, engine)
    assert engine.loaded == ["iter_0000002"] and engine.saved == [4, 6], "resumed from step 2, steps 3.. rerun"
    assert [p.name for p in dirs.set_aside_folders()] == ["iter_0000004.bad-checksum"]
    assert any("checkpoint verified: 2 files" in line and "GB/s per rank" in line for line in ctx.logged)


def test_a_verified_checkpoint_that_fails_to_load_is_skipped_and_kept(tmp_path, caplog):
    """Its files verified, so the failure is not theirs (an out-of-memory during load, a layer kind the load cannot
    take): the previous one is resumed and the good checkpoint is left in place for the next try, not set aside."""
    ctx = Ctx(tmp_path, iters=4)
    train(ctx, Engine(ctx))
    ctx = Ctx(tmp_path, iters=4)
    engine = Engine(ctx, fail_load={"iter_0000004"})
    with caplog.at_level("ERROR", logger="hpc_tools"):
        train(ctx, engine)
    assert engine.loaded == ["iter_0000002"]
    dirs = CheckpointDirs(ctx.checkpoint_dir)
    assert dirs.set_aside_folders() == [] and dirs.final_path(4).is_dir()
    assert "failed to load on rank 0: EOFError: Ran out of input" in caplog.text and "skipped, kept" in caplog.text


def test_none_left_fails_naming_the_file(tmp_path):
    ctx = Ctx(tmp_path, iters=2, interval=None)
    train(ctx, Engine(ctx))
    dirs = CheckpointDirs(ctx.checkpoint_dir)
    corrupt(dirs.final_path(2) / "model.pt", "truncate")
    with pytest.raises(CheckpointError, match=r"iter_0000002/model.pt: \d+ bytes, 3000 at save"):
        train(Ctx(tmp_path, iters=4), Engine(ctx))
    assert [p.name for p in dirs.set_aside_folders()] == ["iter_0000002.bad-size"]


def test_a_bad_load_path_checkpoint_is_skipped_not_renamed(tmp_path):
    src = Ctx(tmp_path / "src", iters=4)
    train(src, Engine(src))
    corrupt(CheckpointDirs(src.checkpoint_dir).final_path(4) / "optim.pt", "missing")
    ctx = Ctx(tmp_path / "dst", iters=4, load_path=str(src.checkpoint_dir))
    engine = Engine(ctx)
    train(ctx, engine)
    assert engine.loaded == ["iter_0000002"]
    assert CheckpointDirs(src.checkpoint_dir).set_aside_folders() == [], "another run's folder is left as it is"


def test_nonfinite_steps_are_counted_never_saved_and_stop_past_the_limit(tmp_path):
    ctx = Ctx(tmp_path, iters=8, interval=2, limit=2)
    engine = Engine(ctx, nonfinite={4, 6, 7})
    collector = train(ctx, engine)
    assert engine.saved == [2, 8], "no checkpoint of the non-finite steps 4 and 6"
    assert [r for r in collector.rows if r[1]] == [(4, True, True), (6, True, True), (7, True, True)]
    assert any("checkpoint of step 4 not saved" in line for line in ctx.logged)
    ctx = Ctx(tmp_path / "b", iters=8, interval=1, limit=2)
    engine = Engine(ctx, nonfinite={3, 4, 5})
    with pytest.raises(loop.NonFiniteError, match=r"step 5: .* for 3 step\(s\) in a row, steps 3..5 "
                                                  r"\(training.max_nonfinite_steps=2\)"):
        train(ctx, engine)
    assert engine.saved == [1, 2] and CheckpointDirs(ctx.checkpoint_dir).newest_step() == 2, "the good one kept"
    with pytest.raises(loop.NonFiniteError, match="step 1: "):
        train(Ctx(tmp_path / "c", limit=0), Engine(ctx, nonfinite={1}))


def test_injection_hook(monkeypatch):
    monkeypatch.delenv(loop.INJECT_NONFINITE_ENV, raising=False)
    assert not loop.nonfinite_injected(3, 0)
    monkeypatch.setenv(loop.INJECT_NONFINITE_ENV, "3,5@1")
    assert [(s, r) for s in range(1, 7) for r in (0, 1) if loop.nonfinite_injected(s, r)] == [(3, 1), (5, 1)]
    monkeypatch.setenv(loop.INJECT_NONFINITE_ENV, "4")
    assert loop.nonfinite_injected(4, 0) and loop.nonfinite_injected(4, 3) and not loop.nonfinite_injected(5, 0)
