"""Before the first step: the checkpoint a run continues from, verified on every rank and loaded into the engine.

The resume source (``checkpoint_dirs.resume_source``: the run's newest complete checkpoint, or
``checkpoint.load_path``; with a node-local tier the newest one the nodes hold together, ``node_tier.candidate``) is
verified on every rank (``agree.agree``: sizes, and checksums unless ``checkpoint.verify: size``) and handed to
``engine.resume``, whose step the run continues from (steps are 1-based and continue across resumes). A checkpoint
that fails verification is set aside (``CheckpointDirs.set_aside``), one that verified but failed to load is skipped,
and the next older complete one is tried; with none left the run fails naming the file (``CheckpointError``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_tools.checkpoints.dirs import CheckpointDirs, parse_step, resume_source
from hpc_tools.checkpoints.verify import Problem
from hpc_tools.errors import UserError
from hpc_tools.train.checkpointing import agree, node_tier
from hpc_tools.train.checkpointing.saver import tiers
from hpc_tools.train.engine import RankJob

if TYPE_CHECKING:
    from hpc_tools.runtime.context import RankContext

log = logging.getLogger("hpc_tools")


class CheckpointError(RuntimeError):
    """Every checkpoint the run could resume from failed verification or loading."""


def resume(ctx: "RankContext", engine: RankJob) -> int:
    """Load the checkpoint the recipe asks for into ``engine``; the last completed step (0 for a fresh start).

    Collective. Each candidate (``resume_source``, newest first) is verified by every rank's share and then loaded;
    one that fails verification is set aside when it is the run's own (renamed ``iter_N.bad-<reason>``, never
    deleted); one that fails to load after its files verified (an out-of-memory, a library mismatch: not the files'
    fault) or came from ``checkpoint.load_path`` is skipped, left as it is; each is logged with the file and the
    reason, and the next older one is tried. None left after a failure: ``CheckpointError`` naming the file(s)."""
    if not engine.checkpoints:
        return 0
    ck = ctx.recipe.checkpoint
    dirs, local = tiers(ctx)  # the shared tier, and this node's folder of the node-local one when in use
    nodes = node_tier.Nodes.of(ctx) if local is not None and ck.resume else None
    if ck.resume:
        for tier in (dirs, local) if local is not None else (dirs,):
            for path, why in tier.incomplete():
                ctx.info("checkpoint %s is not complete, not resumed from: %s", path, why)
    skip: list[Path] = []
    failures: list[str] = []
    while True:
        # the local tier: the newest checkpoint the nodes hold together (collective), copied to every node when it
        # is newer than the shared tier's (on a tie the shared, durable one)
        cand = node_tier.candidate(local, nodes, skip) if nodes is not None else None
        source = resume_source(dirs, resume=ck.resume, load_path=None if cand else ck.load_path, skip=skip)
        share = None
        own = source is not None and source.parent == dirs.root
        if cand is not None and (not own or cand.step > parse_step(source.name)):
            source, share = node_tier.assemble(local, nodes, cand), nodes.share
        if source is None:
            if failures:
                raise CheckpointError("no checkpoint left to resume from: " + "; ".join(failures)
                                      + " (set aside: the folders named *.bad-*; fix or remove them, or fix the "
                                        "load error, to retry)")
            return 0
        step, problem = _verified_load(ctx, engine, source, checksum=ck.verify == "checksum", share=share)
        tier, leads = (local, nodes.is_leader) if share else (dirs if own else None, ctx.is_rank0)
        if problem is None:
            if leads and tier is not None:
                tier.mark_verified(source)  # kept by keep_last until a later resume verifies a newer one
            return step
        failures.append(problem.line(source))
        skip.append(source)
        verified = problem.reason == "load"  # its files passed verification: kept, only skipped
        moved = tier.set_aside(source, problem.reason, problem.line(source)) \
            if leads and tier is not None and not verified else None
        if ctx.is_rank0:
            log.error("checkpoint %s is bad: %s; %s; falling back to the previous complete checkpoint", source,
                      problem.line(source), f"set aside as {moved.name}" if moved else
                      "skipped, kept (its files verified)" if verified else "skipped (checkpoint.load_path)")
        agree.gather(None)  # the others wait for the rename before listing the folder again


def _verified_load(ctx: "RankContext", engine: RankJob, source: Path, *, checksum: bool,
                   share: tuple[int, int] | None = None):
    """Collective: (step, None) once ``source`` verified and loaded on every rank, else (None, the first problem).
    ``share``: this rank's part among the ranks that see the same copy (``agree.agree``)."""
    meta = CheckpointDirs.read_meta(source)
    problems, cost = agree.agree(source, meta, checksum=checksum, share=share)
    if problems:
        for p in problems[1:]:
            ctx.info("  also: %s", p.line(source))
        return None, problems[0]
    t0 = time.perf_counter()
    step, error = None, None
    try:
        step = engine.resume(source)
    except UserError:
        raise  # a checkpoint of the wrong kind for this recipe: the user's to fix, not a corrupt one
    except Exception as e:  # noqa: BLE001 - any failure to load falls back, with its type and text
        error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
    load_s = time.perf_counter() - t0
    errors = [(r, e) for r, e in enumerate(agree.gather(error)) if e]
    if errors:
        rank, text = errors[0]
        return None, Problem(".", "load", f"failed to load on rank {rank}: {text}")
    verify_s = cost["seconds"]
    ctx.info("checkpoint verified: %d files in %.2f s (%s; %.3f GB checksummed, %.2f GB/s per rank), loaded in "
             "%.2f s: verification = %.0f%% of verify+load", cost["files"], verify_s,
             "sizes and checksums" if cost["checksums"] else "sizes only", cost["bytes"] / 1e9,
             cost["gb_per_s_per_rank"], load_s, 100.0 * verify_s / max(verify_s + load_s, 1e-9))
    ctx.info("resumed from %s at step %d", source, step)
    return step, None
