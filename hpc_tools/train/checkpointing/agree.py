"""The ranks' part of checkpoint verification (``hpc_tools.checkpoints.verify`` is the files' part): at save every
rank records its share of the files and rank 0 gathers the lists; at load every rank verifies its share and all agree,
so that every rank falls back to the same checkpoint. Collectives are no-ops in a single process without
torch.distributed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable

from hpc_tools.checkpoints.verify import ALGORITHM, Known, Problem, record_share, verify_share


def live_dist():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world() -> tuple[int, int]:
    dist = live_dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (one all_gather_object; only at save and resume)."""
    dist = live_dist()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_records(folder: Path, *, checksum: bool, exclude: Iterable[str] = (),
                   share: tuple[int, int] | None = None, known: Known | None = None) -> dict[str, Any]:
    """Collective at save: every rank records its share of ``folder``; returns the meta's ``files`` value (on every
    rank): ``{"algorithm", "world_size", "by_rank": {"0": {...}, ...}, "seconds": slowest rank}``. ``share`` =
    (index, count) among the ranks that see the same copy of ``folder`` (a node-local one: the node's ranks, each
    recording its node's own files); default: every rank, one copy. ``known``: this rank's checksums taken ahead
    (``verify.own_checksums``, after a background write), not taken again."""
    index, count = share or rank_and_world()
    t0 = time.perf_counter()
    mine = record_share(folder, index, count, checksum=checksum, exclude=exclude, known=known)
    lists = gather((mine, time.perf_counter() - t0))
    return {"algorithm": ALGORITHM if checksum else None, "world_size": len(lists),
            "by_rank": {str(r): entries for r, (entries, _) in enumerate(lists)},
            "seconds": max(s for _, s in lists)}


def agree(folder: Path, meta: dict[str, Any], *, checksum: bool, share: tuple[int, int] | None = None
          ) -> tuple[list[Problem], dict[str, float]]:
    """Collective at load: every rank verifies its share; returns every rank's problems and the cost
    (files, bytes checksummed, the slowest rank's seconds, GB/s per rank). ``share`` = (index, count) among the ranks
    that see the same copy of ``folder`` (a node-local one: the node's ranks); default: every rank, one copy."""
    rank, world = share or rank_and_world()
    mine = verify_share(folder, meta, rank, world, checksum=checksum)
    everyone = gather(mine)
    problems = [p for v in everyone for p in v.problems]
    slowest = max(v.seconds for v in everyone)
    cost = {"files": sum(v.files for v in everyone), "bytes": sum(v.bytes for v in everyone), "seconds": slowest,
            "checksums": any(v.checksums for v in everyone),
            "gb_per_s_per_rank": max((v.bytes / v.seconds / 1e9 for v in everyone if v.seconds > 0), default=0.0)}
    return problems, cost
