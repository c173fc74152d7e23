"""The saves of every backend: when a step saves and to which tier, background writes, the one commit that makes a
checkpoint complete, and the record of each save (``checkpoint.interval_iters``, ``checkpoint.async_save``,
``checkpoint.local_dir``; docs/checkpoints.md). This is the only reader of those settings on the ranks.

An engine writes its files (``write_checkpoint(folder, step, background)``: everything its library writes, returning
``None`` when the files are on disk or a ``Write`` when they are still being written in the background) and says what
its meta file holds (``checkpoint_meta(step)``): ``hpc_tools.train.engine.Checkpointable``. This module does the rest,
the same for every backend::

    save(step, last_step)  # the loop, at the end of every step: collective
        poll()             # a background write that every rank finished is committed (one flag all-reduce, MIN)
        tier_due(...)      # shared on a stop, at the last step, every interval_iters; else local every
                           # local_interval_iters; nothing after a non-finite step
        save_to(step, tier)
            drain()        # one background write at a time: the previous one is committed first
            begin          # rank 0 (the tier's root; each node's leader on the local tier): iter_N.partial
            barrier
            write          # engine.write_checkpoint(partial, ...): sync, or background: pending until every
                           # rank's write is done (poll / drain)
    commit                 # Write.finish() (the library's collective end, e.g. torch_dist's metadata),
            barrier
            gather         # every rank's sizes and checksums (agree.gather_records; after a background write each
                           # rank checksummed its own files in a thread once its write ended: only gathered here)
            commit         # rank 0 renames the partial folder to iter_N and moves `latest` (CheckpointDirs.commit)
    close()                # after an error: the background writer is stopped, its folder stays partial

So ``latest`` moves only after the background write and its checksums are complete on every rank; a write that
fails or is killed is never committed (its partial folder is removed, the previous checkpoint stays ``latest``); a
process killed during the write leaves only a partial folder, which no resume reads. The last step's save and a stop's
save are synchronous and come after the outstanding write is committed, so a run never ends or requeues with a write
in flight. ``save_once`` is the same sequence for one synchronous save outside a run (test drivers).

Tiers: ``shared`` (``checkpoint.dir``: every ``interval_iters``, the last step, a stop) and ``local``
(``checkpoint.local_dir``/<run folder>, node-local disk: every ``local_interval_iters``; on several nodes each node's
leader begins and commits its node's folder, the commit records each node's own files, and after it each leader
copies them to the next node in the background: ``node_tier``, ``replica``; the next local commit and the end of the
run wait for that copy). A local save that finds no room (this node's part of the newest checkpoint does not fit in
the free space, or the write fails with an ``OSError``) goes to the shared tier instead, told in one line. A resume
takes the newest complete checkpoint of either tier (``resume.resume``; the local one as the nodes hold it together).

Every save gives one ``SaveRecord`` {iteration, tier, async, blocked_s, write_s, verified}: the saver writes it as the
collector's ``checkpoint_save`` event (seconds = blocked_s: the goodput's "checkpoint blocked" bucket), after the
collector flushed the records of the steps before it, and ``status --json`` lists them.

The hang watchdog's step clock stops during ``save`` and ``finish`` (``Watchdog.outside_step``): a save is bounded by
its own progress instead (each phase, each chunk of a replica waited for), so a long save is not a hang, and a save
stuck in one phase for the watchdog's timeout still is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from hpc_tools.checkpoints.dirs import META, CheckpointDirs
from hpc_tools.checkpoints.verify import own_checksums
from hpc_tools.train.checkpointing import agree, node_tier, replica
from hpc_tools.train.engine import Checkpointable, Collector, NullCollector, Write

if TYPE_CHECKING:
    from hpc_tools.runtime.context import RankContext

log = logging.getLogger("hpc_tools")

SHARED, LOCAL = "shared", "local"
INJECT_KILL_WRITER_ENV = "HPC_TOOLS_INJECT_KILL_CKPT_WRITER"
"""Fault injection for tests only: ``"4"`` kills (SIGKILL) rank 0's background writer of the step-4 save right after
it started, as a crash of the writer mid-write would."""
INJECT_LOCAL_FREE_ENV = "HPC_TOOLS_INJECT_LOCAL_FREE_BYTES"
"""Fault injection for tests only (where no small filesystem can be mounted): the local tier's free space is taken
as at most this many bytes."""
ROOM_MARGIN = 1.10
"""A local save needs the newest checkpoint's size x this much free space (shards grow little between saves)."""


@dataclass
class SaveRecord:
    """What one save cost and left: the ``checkpoint_save`` event's fields and ``status --json``'s ``checkpoints``."""

    iteration: int
    tier: str
    async_: bool
    blocked_s: float
    """Wall time training stood still for it: the save call (staging the state into a copy, for a background save)
    plus the commit at a later step boundary, plus any wait for its write (a save due, or the end of the run,
    before it was done)."""
    write_s: float
    """From the save call to the end of the write (the slowest rank's known end; for a background write at best the
    poll that found it done)."""
    verified: bool
    """Committed with every rank's file sizes (and checksums unless checkpoint.verify: size): a resume can verify
    it. False for a save that failed or was killed (never `latest`)."""
    path: str
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["async"] = d.pop("async_")
        return d


@dataclass
class _Pending:
    step: int
    tier: str
    dirs: CheckpointDirs
    write: Write
    t_start: float
    blocked_s: float
    checksums: "_Checksums | None" = None


class _Checksums:
    """This rank's checksums of the files it wrote in a background save (``verify.own_checksums``), taken in a thread
    as soon as its write has ended, so that the commit at a step boundary only gathers them."""

    def __init__(self, folder: Path, index: int):
        import threading

        self.known: dict | None = None
        self._thread = threading.Thread(target=self._run, args=(folder, index), daemon=True, name="ckpt-checksums")
        self._thread.start()

    def _run(self, folder: Path, index: int) -> None:
        try:
            self.known = own_checksums(folder, index)
        except OSError:  # a failed write's files: the commit finds the failure (and records what is there itself)
            self.known = {}

    def done(self) -> bool:
        return not self._thread.is_alive()


def expand_dir(raw: str) -> tuple[Path | None, str]:
    """``checkpoint.local_dir`` with ``~`` and environment variables expanded on this node; (None, why) when a
    variable it names is not set here."""
    expanded = os.path.expanduser(os.path.expandvars(raw))
    if "$" in expanded:
        return None, f"checkpoint.local_dir={raw}: {expanded[expanded.index('$'):].split('/')[0]} is not set here"
    return Path(expanded), ""


def local_tier(ctx: "RankContext") -> CheckpointDirs | None:
    """The node-local tier's folders on this node: ``<local_dir>/<run folder name>`` (runs that share a local_dir
    never read each other's checkpoints), or None (not configured, a variable it names unset on some node, or one
    folder seen by several nodes: told). Collective: every rank gets the same answer."""
    ck = ctx.recipe.checkpoint
    if not ck.local_dir or not ck.local_interval_iters:
        return None
    root, why = expand_dir(ck.local_dir)
    whys = [w for w in _gather(why if root is None else None) if w]
    if whys:
        if ctx.is_rank0:
            log.warning("%s: the local checkpoint tier is off, every save goes to checkpoint.dir", whys[0])
        return None
    dirs = CheckpointDirs(root / Path(ctx.run_dir).name, keep_last=ck.keep_last)
    if node_tier.one_folder(dirs.root, node_tier.Nodes.of(ctx)):
        if ctx.is_rank0 and str(dirs.root) not in _TOLD:
            _TOLD.add(str(dirs.root))
            log.warning("checkpoint.local_dir=%s is the same folder on every node (a shared file system): the local "
                        "checkpoint tier is off, every save goes to checkpoint.dir (give a node-local path, e.g. "
                        "/tmp/$SLURM_JOB_ID/ckpt or /scratch/$SLURMD_NODENAME)", ck.local_dir)
        return None
    return dirs


_TOLD: set[str] = set()
"""Local tiers already told to be one folder on every node (the resume and the saver both ask)."""


def tiers(ctx: "RankContext") -> tuple[CheckpointDirs, CheckpointDirs | None]:
    """The run's own checkpoint roots: the shared tier, and this node's folder of the node-local one when in use
    (``local_tier``; collective, nothing logged twice)."""
    ck = ctx.recipe.checkpoint
    return CheckpointDirs(ctx.checkpoint_dir, keep_last=ck.keep_last), local_tier(ctx)


def checkpoint_bytes(path: Path) -> int:
    """The bytes a complete checkpoint's meta records (0 when unreadable)."""
    try:
        meta = CheckpointDirs.read_meta(path)
        return sum(int(e.get("size") or 0) for entries in meta["files"]["by_rank"].values()
                   for e in entries.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def _flag_all(value: bool, device) -> bool:
    """Collective: ``value`` on every rank (MIN all-reduce of one flag)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([1.0 if value else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.item() == 1.0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _error_line(e: BaseException) -> str:
    return (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0][:300]


class Saver:
    """The saves of one run on one rank (every method is a collective except ``tier_due``).

    ``collector``: the records of the run (``engine.Collector``): flushed before each save, given each save's
    ``checkpoint_save`` event."""

    def __init__(self, ctx: "RankContext", engine: Checkpointable, collector: Collector | None = None):
        ck = ctx.recipe.checkpoint
        local = local_tier(ctx)
        self._setup(engine, CheckpointDirs(ctx.checkpoint_dir, keep_last=ck.keep_last), local=local,
                    nodes=node_tier.Nodes.of(ctx) if local is not None else None, rank0=ctx.is_rank0, info=ctx.info,
                    device=ctx.device if ck.async_save else None, collector=collector)
        self.replicate = bool(ck.local_replicate)
        self.watchdog = getattr(ctx, "watchdog", None)
        if local is not None and self.replicate and self.nodes.count > 1:
            self.replicator = replica.Replicator.of(ctx, self.nodes)  # collective: the leaders' group, made up front
        self.background = bool(ck.async_save)
        self.checksum = ck.verify == "checksum"
        self.interval, self.local_interval = ck.interval_iters, ck.local_interval_iters
        if self.background:
            engine.start_background_writer()  # its start (processes, a CUDA context) overlaps training, not a save

    @classmethod
    def outside_run(cls, engine: Checkpointable, dirs: CheckpointDirs, *, checksum: bool = True) -> "Saver":
        """A saver of synchronous saves into ``dirs`` outside a training run (``save_once``): no local tier, no
        background writes, no records; rank 0 of torch.distributed (when up) leads."""
        rank0 = agree.rank_and_world()[0] == 0
        saver = cls.__new__(cls)
        saver._setup(engine, dirs, local=None, nodes=None, rank0=rank0,
                     info=lambda msg, *args: log.info(msg, *args) if rank0 else None, device=None, collector=None)
        saver.replicate = saver.background = False
        saver.checksum = checksum
        saver.interval = saver.local_interval = None
        return saver

    def _setup(self, engine: Checkpointable, shared: CheckpointDirs, *, local: CheckpointDirs | None,
               nodes: "node_tier.Nodes | None", rank0: bool, info: Callable[..., None], device: Any,
               collector: Collector | None) -> None:
        self.engine, self.shared, self.local, self.nodes = engine, shared, local, nodes
        self.is_rank0, self.info, self.device = rank0, info, device
        self.collector = collector if collector is not None else NullCollector()
        self.pending: _Pending | None = None
        self.replicator: replica.Replicator | None = None  # the node-local tier's background copies (several nodes)
        self.watchdog = None
        self.shared_next = False  # a background write to the local tier failed: the next save goes to the shared one
        self.kill_step = _kill_step()

    # -- when ----------------------------------------------------------------------------------------------------------
    def save(self, step: int, last_step: int, *, stop: bool = False, nonfinite: bool = False) -> list[SaveRecord]:
        """The loop's one call, at the end of every step (collective; every rank passes the same arguments): commit
        a finished background write, then save step ``step`` when a tier is due (``tier_due``) unless the step was
        not finite (a checkpoint never holds what a non-finite step left behind). Each save that ended is told:
        rank 0's line and the collector's ``checkpoint_save`` event; returns their records. Outside the hang
        watchdog's step clock (bounded by its progress instead)."""
        with self._outside_step():
            return self._save(step, last_step, stop=stop, nonfinite=nonfinite)

    def _save(self, step: int, last_step: int, *, stop: bool, nonfinite: bool) -> list[SaveRecord]:
        records = self.poll()
        tier = self.tier_due(step, last_step, stop)
        final = stop or step == last_step
        if tier is not None and nonfinite:
            self.info("checkpoint of step %d not saved: the step was not finite (the newest checkpoint stays the last "
                      "good one)", step)
            if final:
                records += self.drain()
        elif tier is not None:
            self.collector.flush()  # the checkpoint's steps are on disk before it
            records += self.save_to(step, tier, final=final)
        for rec in records:
            self._report(rec)
        return records

    def finish(self) -> list[SaveRecord]:
        """At the end of a run: commit and tell a write still pending (none after the last step's save; kept for a
        run that saved nothing), and wait for the last local save's replica (``_wait_replica``)."""
        with self._outside_step():
            records = self.drain()
            for rec in records:
                self._report(rec)
            self._wait_replica()
        return records

    def tier_due(self, step: int, last: int, stop: bool) -> str | None:
        """The tier step ``step`` saves to, or None: shared on a stop, at the last step and every interval_iters;
        else local every local_interval_iters."""
        if stop or step == last or (self.interval and step % self.interval == 0):
            return SHARED
        if self.local is not None and self.local_interval and step % self.local_interval == 0:
            return SHARED if self.shared_next else LOCAL
        return None

    # -- saving --------------------------------------------------------------------------------------------------------
    def save_to(self, step: int, tier: str, *, final: bool) -> list[SaveRecord]:
        """Save step ``step`` to ``tier`` (after committing an outstanding background write); in the background
        with checkpoint.async_save unless ``final`` (the last step, a stop). Returns the records of the saves that
        ended here (the previous background one, this one when synchronous)."""
        records = self.drain()
        t0 = time.perf_counter()
        dirs = self.shared
        if tier == LOCAL:
            why = self._local_no_room()
            if why is None:
                dirs = self.local
            else:
                self._tell_fallback(step, why)
                tier = SHARED
        if tier == SHARED:
            self.shared_next = False  # the shared save that a failed local write asked for
        background = self.background and not final
        write, error = None, None
        try:
            partial = self._begin(dirs, step)
            self._progress()
            time.sleep(_injected_save_s(self.collector))  # a slow checkpoint folder (tests only; 0 otherwise)
            write = self.engine.write_checkpoint(partial, step, background=background)
            self._progress()
        except BaseException as e:  # torch's CheckpointException (a failed shard write) is a BaseException
            if tier != LOCAL or isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            error = _error_line(e)
        if tier == LOCAL:  # every rank takes the same branch: a full local disk on any rank moves the save
            errors = [e for e in _gather(error) if e]
            if errors:
                if write is not None:
                    write.abort()
                self._discard(dirs, step)
                self._tell_fallback(step, errors[0])
                return records + self.save_to(step, SHARED, final=final)
        if self.kill_step == step and write is not None and self.is_rank0:
            write.kill()
        if write is None:
            records.append(self._commit(_Pending(step, tier, dirs, None, t0, 0.0)))
            return records
        self.pending = _Pending(step, tier, dirs, write, t0, time.perf_counter() - t0)
        parts = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.3f} s" for k, v in getattr(write, "parts", {}).items())
        self.info("checkpoint of step %d staged in %.3f s (%s tier%s); written in the background, complete once "
                  "every rank's write is done", step, self.pending.blocked_s, tier, f": {parts}" if parts else "")
        return records

    def poll(self) -> list[SaveRecord]:
        """At a step boundary: commit the background write once every rank's is done (one all-reduce while one is
        pending; nothing otherwise)."""
        if self.pending is None:
            return []
        if not _flag_all(self._written(self.pending), self.device):
            return []
        return [self._commit(self.pending)]

    def drain(self) -> list[SaveRecord]:
        """Wait for the outstanding background write and commit it (before another save, the end, a stop)."""
        if self.pending is None:
            return []
        t0 = time.perf_counter()
        while not self._written(self.pending):
            time.sleep(0.005)
        self.pending.blocked_s += time.perf_counter() - t0  # training waits for this write: blocked by it
        return [self._commit(self.pending)]

    def _written(self, p: _Pending) -> bool:
        """This rank's background write has ended and, with checksums, its own files are checksummed (started
        here, in a thread, once the write has ended)."""
        if not p.write.done():
            return False
        if not self.checksum:
            return True
        if p.checksums is None:
            index = self.nodes.share[0] if p.tier == LOCAL else agree.rank_and_world()[0]
            p.checksums = _Checksums(p.dirs.partial_path(p.step), index)
        return p.checksums.done()

    def close(self) -> None:
        """After an error: stop an outstanding background write without committing it (its folder stays partial,
        never resumed from)."""
        if self.pending is not None:
            with contextlib.suppress(Exception):
                self.pending.write.abort()
            self.info("background checkpoint write of step %d not committed (the run ended with an error): its "
                      "folder stays partial", self.pending.step)
            self.pending = None

    def _report(self, rec: SaveRecord) -> None:
        """Rank 0's line for a save that ended, and the collector's ``checkpoint_save`` event with its record."""
        if rec.verified and not rec.async_:
            self.info("checkpoint saved: %s%s", rec.path, self._cost(Path(rec.path), rec.write_s))
        elif rec.verified:
            self.info("checkpoint of step %d: blocked training %.3f s of a %.2f s background write (%s tier)",
                      rec.iteration, rec.blocked_s, rec.write_s, rec.tier)
        fields = rec.as_dict()
        fields.pop("iteration")
        self.collector.event("checkpoint_save", rec.blocked_s, step=rec.iteration, **fields)

    def _cost(self, path: Path, seconds: float) -> str:
        """`` in S s (file lists R s = P%)`` for rank 0's save line, from the meta file the save committed."""
        if not self.is_rank0:
            return ""
        try:
            record_s = float(CheckpointDirs.read_meta(path)["files"]["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        share = 100 * record_s / max(seconds, 1e-9)
        return f" in {seconds:.2f} s (file lists and checksums {record_s:.2f} s = {share:.1f}%)"

    # -- the steps of one save -----------------------------------------------------------------------------------------
    def _leads(self, dirs: CheckpointDirs) -> bool:
        """Whether this rank changes ``dirs``' folders: global rank 0 on the shared tier, each node's leader on its
        node's local folder."""
        return self.nodes.is_leader if dirs is self.local and self.nodes is not None else self.is_rank0

    def _begin(self, dirs: CheckpointDirs, step: int) -> Path:
        error = None
        if self._leads(dirs):
            try:
                dirs.begin(step)
            except OSError as e:
                error = e
        _barrier()
        if error is not None:
            raise error
        return dirs.partial_path(step)

    def _commit(self, p: _Pending) -> SaveRecord:
        t0 = time.perf_counter()
        self.pending = None
        error = None
        if p.write is not None:
            try:
                p.write.finish()
            except BaseException as e:  # torch's CheckpointException is a BaseException; never committed
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                error = _error_line(e)
        ended = (p.write.ended if p.write is not None else None) or t0
        errors = [e for e in _gather(error) if e] if p.write is not None else []
        if errors:
            self._discard(p.dirs, p.step)
            latest = p.dirs.newest()
            if p.tier == LOCAL:
                self.shared_next = True
            if self.is_rank0:
                log.error("checkpoint of step %d (%s tier, written in the background) failed: %s; not committed, "
                          "%s stays the newest%s", p.step, p.tier, errors[0],
                          latest.name if latest is not None else "no checkpoint",
                          "; the next save goes to the shared tier" if p.tier == LOCAL else "")
            return SaveRecord(p.step, p.tier, True, p.blocked_s + time.perf_counter() - t0, ended - p.t_start, False,
                              str(p.dirs.partial_path(p.step)), note=errors[0])
        partial = p.dirs.partial_path(p.step)
        _barrier()
        local = p.tier == LOCAL  # each node its own folder: its own files recorded, then copied to the next node
        files = agree.gather_records(partial, exclude=[META], checksum=self.checksum,
                                     share=self.nodes.share if local else None,
                                     known=p.checksums.known if p.checksums is not None else None)
        moves = []
        if local:
            own = node_tier.own_files(partial, self.nodes)  # before any replica: the next node's copy is of these
            moves = node_tier.replica_moves(own) if self.replicator is not None else []
            self._wait_replica()  # the previous local save's copy ends before this commit prunes its folder
        self._progress()
        final = p.dirs.final_path(p.step)
        if self._leads(p.dirs):
            meta = {**self.engine.checkpoint_meta(p.step), "tier": p.tier, "async": p.write is not None}
            if p.tier == LOCAL:
                meta["nodes"] = self.nodes.count
            final = p.dirs.commit(p.step, meta=meta, files=files)
            if moves and self.replicator is not None:
                self.replicator.start(p.step, final, moves)  # in the background: training goes on
        if self.is_rank0 and p.write is not None:
            self.info("checkpoint of step %d complete (written in the background, %s tier): %s", p.step, p.tier,
                      final)
        _barrier()
        now = time.perf_counter()
        if p.write is None:
            return SaveRecord(p.step, p.tier, False, now - p.t_start, now - p.t_start, True, str(final))
        write_s = max(_gather(ended - p.t_start))
        return SaveRecord(p.step, p.tier, True, p.blocked_s + now - t0, write_s, True, str(final))

    def _wait_replica(self) -> None:
        """Collective: wait for the previous local save's replica (leaders: ``Replicator.wait``), then tell how it
        ended: rank 0's line; one that failed or stalled on any node turns replication off for the rest of the run on
        every rank (its folder's replica stays partial, never used; each node keeps its own files)."""
        if self.replicator is None:
            return
        t0 = time.perf_counter()
        mine = self.replicator.wait(self._progress) if self.nodes.is_leader else None
        waited = time.perf_counter() - t0
        outcomes = [o for o in _gather(mine) if o is not None]
        if not outcomes:
            return
        failed = [o for o in outcomes if o.error]
        step = outcomes[0].step
        if failed:
            self.replicator.retire()
            self.replicator = None
            if self.is_rank0:
                log.warning("replica of local checkpoint step %d not complete (node %d: %s): not used for recovery; "
                            "replication is off for the rest of this run, each node keeps its own files only (check "
                            "the network between the nodes, or checkpoint.local_replicate_interface)", step,
                            failed[0].node, failed[0].error)
        else:
            slowest = max(o.seconds for o in outcomes)
            self.info("replica of local checkpoint step %d complete on every node: %.3f GB in %.2f s in the "
                      "background (training waited %.3f s for it)", step, sum(o.bytes for o in outcomes) / 2e9,
                      slowest, waited)

    def _outside_step(self):
        """The hang watchdog's step clock stopped (a save is bounded by its progress), or nothing without one."""
        return self.watchdog.outside_step("checkpoint save") if self.watchdog is not None else \
            contextlib.nullcontext()

    def _progress(self) -> None:
        if self.watchdog is not None:
            self.watchdog.progress()

    def _discard(self, dirs: CheckpointDirs, step: int) -> None:
        if self._leads(dirs):
            shutil.rmtree(dirs.partial_path(step), ignore_errors=True)
        _barrier()

    def _local_no_room(self) -> str | None:
        """Collective: why the local tier cannot take a save now (each node's leader looks at its disk), or None."""
        why = None
        if self.nodes.is_leader:
            root = self.local.root
            newest = self.local.newest() or self.shared.newest()
            held = min(1.0, (1 + self.replicate) / self.nodes.count)  # this node's part of a whole checkpoint
            need = int(checkpoint_bytes(newest) * held * ROOM_MARGIN) if newest is not None else 0
            try:
                root.mkdir(parents=True, exist_ok=True)
                free = shutil.disk_usage(root).free
                if os.environ.get(INJECT_LOCAL_FREE_ENV, "").isdigit():
                    free = min(free, int(os.environ[INJECT_LOCAL_FREE_ENV]))
                if not os.access(root, os.W_OK):
                    why = f"{root} is not writable"
                elif need and free < need:
                    why = f"{root} has {free / 1e6:.1f} MB free, the checkpoint needs ~{need / 1e6:.1f} MB"
            except OSError as e:
                why = _error_line(e)
            if why and self.nodes.count > 1:
                why = f"node {self.nodes.node}: {why}"
        return next((w for w in _gather(why) if w), None)

    def _tell_fallback(self, step: int, why: str) -> None:
        if self.is_rank0:
            log.warning("local checkpoint tier full or unusable (%s): step %d saved to the shared tier %s instead",
                        why, step, self.shared.root)


def _gather(obj: Any) -> list[Any]:
    return agree.gather(obj)


def _kill_step() -> int | None:
    spec = os.environ.get(INJECT_KILL_WRITER_ENV, "").strip()
    return int(spec) if spec.isdigit() else None


def _injected_save_s(collector) -> float:
    """The test-only slow save of ``HPC_TOOLS_TEST_SLOW_RANK`` (``profiling.collector``); 0 for a collector without."""
    injected = getattr(collector, "injected_save_s", None)
    return injected() if injected is not None else 0.0


def save_once(engine: Checkpointable, dirs: CheckpointDirs, step: int, *, checksum: bool = True) -> Path:
    """Collective: one synchronous save of step ``step`` into ``dirs`` outside a training run (test drivers, a
    model-only initial checkpoint): the saver's own begin, write and commit; returns the complete folder."""
    [record] = Saver.outside_run(engine, dirs, checksum=checksum).save_to(step, SHARED, final=True)
    return Path(record.path)
