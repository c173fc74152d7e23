"""The shared save mechanism (``hpc_tools.train.checkpointing.saver``) in one process, with an engine that writes
plain files: ``latest`` moves only once a background write is done and committed, a failed background write is never
committed, a local tier that is full falls back to the shared one (told), a resume takes the newest checkpoint of
either tier, and ``checkpoint.local_dir`` is expanded at run time. The real backends are checked in
tests/integration/test_checkpoint_async.py."""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_tools.checkpoints.dirs import LATEST, CheckpointDirs, newest_across, resume_source
from hpc_tools.recipe.checkpoint import CheckpointConfig
from hpc_tools.train.checkpointing.saver import LOCAL, SHARED, Saver, expand_dir
from tests.helpers import REPO


class FakeWrite:
    def __init__(self):
        self.finished, self.fail, self.ended = False, None, None

    def done(self) -> bool:
        return self.finished

    def finish(self) -> None:
        if self.fail:
            raise self.fail

    def abort(self) -> None:
        pass

    def kill(self) -> None:
        pass


class FakeEngine:
    """Writes one file per save; ``full`` roots raise ENOSPC like a full disk."""

    checkpoints = True

    def __init__(self):
        self.full: set[Path] = set()
        self.writes: list[FakeWrite] = []
        self.started = 0
        self.own_file = ""

    def write_checkpoint(self, folder: Path, step: int, background: bool):
        if folder.parent in self.full:
            (folder / "shard.bin").write_bytes(b"x" * 10)
            raise OSError(errno.ENOSPC, "No space left on device")
        (folder / "shard.bin").write_bytes(bytes([step]) * 100)
        if self.own_file:
            (folder / self.own_file).write_bytes(bytes([step]) * 300)
        if background:
            self.writes.append(FakeWrite())
            return self.writes[-1]
        return None

    def checkpoint_meta(self, step: int) -> dict:
        return {"format": "fake"}

    def start_background_writer(self) -> None:
        self.started += 1


def make_ctx(tmp_path: Path, **ck):
    ck = CheckpointConfig(**{"keep_last": 5, **ck})
    infos: list[str] = []
    return SimpleNamespace(
        recipe=SimpleNamespace(checkpoint=ck), checkpoint_dir=tmp_path / "shared", run_dir=tmp_path / "run", rank=0,
        is_rank0=True, device="cpu",
        dist=SimpleNamespace(world_size=2, local_world_size=2, node_rank=0),
        info=lambda msg, *a: infos.append(msg % a), infos=infos)


def poll_until_committed(saver: Saver) -> list:
    """Step boundaries until the pending write is committed (its own files are checksummed in a thread first)."""
    for _ in range(1000):
        records = saver.poll()
        if records:
            return records
        time.sleep(0.005)
    raise AssertionError("never committed")


def test_a_background_writes_own_files_are_checksummed_before_the_commit_and_only_gathered_there(tmp_path,
                                                                                                  monkeypatch):
    import threading

    from hpc_tools.checkpoints import verify

    hashed: list[tuple[str, str]] = []
    real = verify.file_checksum
    monkeypatch.setattr(verify, "file_checksum",
                        lambda path, buf=None: hashed.append((Path(path).name, threading.current_thread().name))
                        or real(path, buf))
    engine = FakeEngine()
    engine.own_file = "rng_rank00000.pt"  # rank 0's file by its name, as torch_dist's __0_0.distcp
    saver = Saver(make_ctx(tmp_path, async_save=True), engine)
    saver.save_to(2, SHARED, final=False)
    assert saver.poll() == [] and hashed == [], "nothing read while the write is under way"
    engine.writes[-1].finished = True
    [rec] = poll_until_committed(saver)
    assert rec.verified and sorted(hashed) == [("rng_rank00000.pt", "ckpt-checksums"), ("shard.bin", "MainThread")]
    entries = CheckpointDirs.read_meta(Path(rec.path))["files"]["by_rank"]["0"]
    assert entries["rng_rank00000.pt"]["xxh3_64"] == real(Path(rec.path) / "rng_rank00000.pt")


def test_the_saver_alone_reads_async_save_and_starts_the_writer_before_any_save(tmp_path):
    engine = FakeEngine()
    Saver(make_ctx(tmp_path, async_save=True), engine)
    assert engine.started == 1 and engine.writes == [], "started when the saver is built, nothing written"
    Saver(make_ctx(tmp_path / "sync"), engine)
    assert engine.started == 1, "synchronous saves start no writer"


def test_latest_moves_only_when_the_background_write_is_done(tmp_path):
    ctx, engine = make_ctx(tmp_path, async_save=True), FakeEngine()
    saver = Saver(ctx, engine)
    shared = CheckpointDirs(tmp_path / "shared")
    [rec] = saver.save_to(1, SHARED, final=True)  # synchronous
    assert rec.verified and not rec.async_ and shared.newest().name == "iter_0000001"
    assert saver.save_to(2, SHARED, final=False) == []  # staged; written in the background
    assert (shared.root / LATEST).read_text().strip() == "iter_0000001" and shared.newest_step() == 1
    assert saver.poll() == [] and shared.newest_step() == 1  # not done yet
    engine.writes[-1].finished = True
    [rec] = poll_until_committed(saver)
    assert rec.verified and rec.async_ and rec.iteration == 2 and rec.blocked_s <= rec.write_s + 1
    assert (shared.root / LATEST).read_text().strip() == "iter_0000002"
    meta = CheckpointDirs.read_meta(shared.root / "iter_0000002")
    assert meta["async"] is True and meta["tier"] == SHARED and "shard.bin" in meta["files"]["by_rank"]["0"]


def test_the_last_save_waits_for_the_pending_write_and_commits_it_first(tmp_path):
    ctx, engine = make_ctx(tmp_path, async_save=True), FakeEngine()
    saver = Saver(ctx, engine)
    saver.save_to(2, SHARED, final=False)
    write, calls = engine.writes[-1], []

    def done():  # the write ends while the final save waits for it
        calls.append(1)
        return len(calls) >= 3

    write.done = done
    records = saver.save_to(4, SHARED, final=True)  # the last step or a stop: synchronous, after the pending one
    assert [(r.iteration, r.async_, r.verified) for r in records] == [(2, True, True), (4, False, True)]
    assert len(calls) >= 3 and records[0].blocked_s > 0 and saver.pending is None
    shared = CheckpointDirs(tmp_path / "shared")
    assert [s for s, _ in shared.complete()] == [2, 4] and shared.newest_step() == 4


def test_a_failed_background_write_is_never_committed(tmp_path, caplog):
    ctx, engine = make_ctx(tmp_path, async_save=True), FakeEngine()
    saver = Saver(ctx, engine)
    saver.save_to(1, SHARED, final=True)
    saver.save_to(2, SHARED, final=False)
    engine.writes[-1].finished, engine.writes[-1].fail = True, RuntimeError("writer killed")
    with caplog.at_level(logging.ERROR, logger="hpc_tools"):
        [rec] = saver.drain()
    shared = CheckpointDirs(tmp_path / "shared")
    assert not rec.verified and "writer killed" in rec.note
    assert [s for s, _ in shared.complete()] == [1] and not shared.partial_path(2).exists()
    assert (shared.root / LATEST).read_text().strip() == "iter_0000001"
    assert "iter_0000001 stays the newest" in caplog.text


def test_a_full_local_tier_falls_back_to_the_shared_one_and_says_so(tmp_path, caplog):
    ctx, engine = make_ctx(tmp_path, local_dir=str(tmp_path / "local"), local_interval_iters=1,
                           interval_iters=4), FakeEngine()
    saver = Saver(ctx, engine)
    assert [saver.tier_due(s, 8, False) for s in (1, 4, 8)] == [LOCAL, SHARED, SHARED]
    assert saver.tier_due(3, 8, True) == SHARED  # a stop saves to the durable tier
    [rec] = saver.save_to(1, LOCAL, final=False)
    assert rec.tier == LOCAL and CheckpointDirs(tmp_path / "local" / "run").newest_step() == 1
    engine.full.add(tmp_path / "local" / "run")
    with caplog.at_level(logging.WARNING, logger="hpc_tools"):
        [rec] = saver.save_to(2, LOCAL, final=False)
    assert rec.tier == SHARED and rec.verified
    assert CheckpointDirs(tmp_path / "shared").newest_step() == 2
    assert not CheckpointDirs(tmp_path / "local" / "run").partial_path(2).exists()  # the half-written folder is gone
    lines = [r.getMessage() for r in caplog.records if "local checkpoint tier" in r.getMessage()]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "step 2 saved to the shared tier" in lines[0]


def test_a_resume_takes_the_newest_of_either_tier(tmp_path):
    shared, local = CheckpointDirs(tmp_path / "s"), CheckpointDirs(tmp_path / "l")
    for dirs, step in ((shared, 4), (local, 5), (shared, 3)):
        (dirs.begin(step) / "f").write_text("x")
        dirs.commit(step)
    assert newest_across([shared, local]) == local.final_path(5)
    assert resume_source(shared, resume=True, load_path=None, tiers=[local]) == local.final_path(5)
    assert newest_across([shared, local], skip=[local.final_path(5)]) == shared.final_path(4)
    (local.begin(4) / "f").write_text("x")
    local.commit(4)
    assert newest_across([shared, local], skip=[local.final_path(5)]) == shared.final_path(4)  # a tie: shared


def test_local_dir_is_expanded_on_the_node(monkeypatch):
    monkeypatch.setenv("HPCT_NODE_TMP", "/scratch/x")
    assert expand_dir("$HPCT_NODE_TMP/ckpt") == (Path("/scratch/x/ckpt"), "")
    monkeypatch.delenv("HPCT_NODE_TMP")
    path, why = expand_dir("$HPCT_NODE_TMP/ckpt")
    assert path is None and "$HPCT_NODE_TMP is not set" in why


@pytest.mark.parametrize("sets, message", [
    ({"local_interval_iters": 5}, "checkpoint.local_interval_iters=5 needs checkpoint.local_dir"),
    ({"local_dir": "/tmp/x"}, "checkpoint.local_dir=/tmp/x is never written"),
])
def test_local_tier_fields_come_together(sets, message):
    from hpc_tools.errors import RecipeError
    from hpc_tools.recipe.load import load_recipe

    with pytest.raises(RecipeError, match=message.replace(".", r"\.")):
        load_recipe(REPO / "recipes" / "gpt_3d.yaml", [f"checkpoint.{k}={v}" for k, v in sets.items()],
                    profile="local")
