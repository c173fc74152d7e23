"""The node-local checkpoint tier across nodes (``checkpoint.local_dir``): which node each rank is on, each node's
share of a save, the copy of a node's files to its peer, and the assembly of a checkpoint on every node at resume
(docs/checkpoints.md, "The node-local tier").

Each node has its own ``local_dir`` (node-local disk: the same path string, a different disk). A save to the tier::

    every rank writes into <local_dir>/iter_N.partial on its own node (the backend's own files)
    gather_records   every rank records (size, checksum) a share of the files its node wrote (agree,
                     share = the node's ranks); gathered: the meta
    commit           every leader renames its node's folder to iter_N, with the same meta, and moves `latest`
    replicate        after the commit, in the background (``replica.Replicator``: a thread on each leader, over a gloo
                     group of the leaders of its own): node i's files are copied into node i+1's iter_N (mod nodes),
                     when checkpoint.local_replicate (the default); training goes on meanwhile

so every node holds its own files and, once its replica is complete, its predecessor's: a node that is lost (or
replaced by a spare) loses nothing. A replica being received is named by the marker ``REPLICA_PARTIAL`` in the
receiving folder (written before its first file); only when every file arrived is it renamed ``REPLICA_COMPLETE``. The
files a partial marker names are never counted as held (``holdings``): a replica cut short by a crash, a stall or a
lost peer is never used for recovery, while the node's own files of the same checkpoint still are.

At resume the leaders say which complete local checkpoints their node holds (``candidate``); the newest one whose
files the nodes hold together is the candidate, and ``assemble`` copies to each node the files it lacks (a spare
node: all of them), so every node has the whole folder and the backends load it as they load a shared one. A
single-node run is the same with one leader and nothing to copy.

Files travel as uint8 tensors of at most ``CHUNK`` bytes, leader to leader, in one order that every leader walks
(``transfer``): point-to-point sends on the gloo group, one file at a time.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from hpc_tools.checkpoints.dirs import META, CheckpointDirs
from hpc_tools.checkpoints.verify import listing, recorded
from hpc_tools.train import groups
from hpc_tools.train.checkpointing.agree import gather, live_dist

if TYPE_CHECKING:
    from hpc_tools.runtime.context import RankContext

CHUNK = 16 << 20
"""Bytes per message of a file transfer (bounds the memory a transfer takes on each leader)."""

Move = tuple[str, int, int, int]
"""One file's copy: (name relative to the checkpoint folder, from node, to node, size in bytes)."""
REPLICA_PARTIAL = ".replica-partial.json"
"""In a local checkpoint folder while the previous node's files are being received into it: JSON {"from_node",
"files": {name: size}}; its files are not held until the marker becomes ``REPLICA_COMPLETE``."""
REPLICA_COMPLETE = ".replica.json"
"""The replica in this folder is whole (every file received, fsynced): the partial marker renamed, with its cost."""


def node_key(ctx: "RankContext") -> tuple[int, str]:
    """What tells this rank's node from the others: the launcher's node rank (SLURM_NODEID, NODE_RANK) and the node's
    name (Slurm's for its node: several slurmd may share a host)."""
    return ctx.dist.node_rank, os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass
class Nodes:
    """Where this rank stands among the run's nodes."""

    node: int
    """This rank's node, 0..count-1 (nodes in the order of their lowest rank)."""
    count: int
    leaders: list[int]
    """The global rank that speaks for each node (its lowest)."""
    local_index: int
    """This rank's place among its node's ranks."""
    local_count: int
    group: Any = field(default=None, repr=False)
    """A gloo group over the leaders (more than one node), for the file transfers."""

    @property
    def is_leader(self) -> bool:
        return self.local_index == 0

    @property
    def share(self) -> tuple[int, int]:
        """This rank's share of its node's files: (index, count) for ``verify.shares``."""
        return self.local_index, self.local_count

    @classmethod
    def of(cls, ctx: "RankContext") -> "Nodes":
        """Collective (every rank, the same call order): built once per process and kept."""
        dist = live_dist()
        key = (ctx.rank, ctx.dist.world_size, id(dist.group.WORLD) if dist is not None else None, groups.generation())
        if key not in _NODES:
            keys = gather(node_key(ctx))
            order: list[tuple[int, str]] = []
            for k in keys:
                if k not in order:
                    order.append(k)
            mine = keys[ctx.rank]
            members = [r for r, k in enumerate(keys) if k == mine]
            leaders = [keys.index(k) for k in order]
            group = None
            if len(order) > 1 and dist is not None:
                group = dist.new_group(ranks=leaders, backend="gloo")
            _NODES[key] = cls(order.index(mine), len(order), leaders, members.index(ctx.rank), len(members), group)
        return _NODES[key]


_NODES: dict[tuple[int, int, int | None, int], Nodes] = {}
"""Per process, world and generation of groups (``train/groups.py``): ``Nodes.of`` is collective, and the saver and
the resume both ask."""


def one_folder(root: Path, nodes: Nodes) -> bool:
    """Collective: whether ``root`` is the same folder on every node (a shared file system given as the node-local
    tier: the leaders would write and rename one folder at once). Each leader writes a probe file named by a token of
    this call and its node, then looks for another node's, and removes its own before any rank returns; answered once
    per folder and generation of groups."""
    if nodes.count < 2:
        return False
    key = (str(root), groups.generation())
    if key not in _ONE_FOLDER:
        import uuid

        token = gather(uuid.uuid4().hex)[0]
        probe = root / f".node-probe-{token}-{nodes.node}"
        if nodes.is_leader:
            try:
                root.mkdir(parents=True, exist_ok=True)
                probe.touch()
            except OSError:
                pass  # an unusable folder is told by the save's room check
        _barrier()
        seen = nodes.is_leader and any(p != probe for p in root.glob(f".node-probe-{token}-*"))
        _ONE_FOLDER[key] = any(gather(seen))  # collective: every leader has looked before any probe goes
        if nodes.is_leader:
            probe.unlink(missing_ok=True)
        _barrier()  # every probe is gone on return, on every rank (a caller may list the folder next)
    return _ONE_FOLDER[key]


_ONE_FOLDER: dict[tuple[str, int], bool] = {}


# -- saving ----------------------------------------------------------------------------------------------------------
def own_files(folder: Path, nodes: Nodes) -> list[dict[str, int] | None]:
    """Collective: each node's files in ``folder`` as its leader lists them (before any replica arrives), by node."""
    mine = listing(folder, exclude=[META]) if nodes.is_leader else None
    everyone = gather(mine)
    return [everyone[r] for r in nodes.leaders]


def replica_moves(own: Sequence[dict[str, int] | None]) -> list[Move]:
    """Node i's files to node i+1 (mod nodes); nothing for one node."""
    n = len(own)
    if n < 2:
        return []
    return [(name, i, (i + 1) % n, size) for i, files in enumerate(own) for name, size in sorted((files or {}).items())]


# -- resuming --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """A local-tier checkpoint the nodes can restore together."""

    step: int
    moves: list[Move]
    """What each node lacks and where it comes from (the meta file last)."""


def holdings(local: CheckpointDirs, skip: Iterable[Path]) -> dict[int, tuple[dict[str, dict], dict[str, int]]]:
    """This node's complete local checkpoints: {step: (the files its meta records, the files present)}."""
    skipped = set(skip)
    out = {}
    for step, path in local.complete():
        if path in skipped:
            continue
        try:
            files = {n: {"size": e.get("size")} for n, e in recorded(CheckpointDirs.read_meta(path)).items()}
        except (OSError, ValueError):
            continue
        present = listing(path)
        for name in partial_replica(path):  # a replica cut short: none of its files counts
            present.pop(name, None)
        out[step] = (files, present)
    return out


def partial_replica(path: Path) -> list[str]:
    """The names of the replica files ``path`` was receiving when its replication stopped before the end (its
    ``REPLICA_PARTIAL`` marker's list; an unreadable marker: every file but the meta, none of them trusted)."""
    marker = path / REPLICA_PARTIAL
    if not marker.exists():
        return []
    import json

    try:
        return sorted(json.loads(marker.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(n for n in listing(path) if n != META)


def plan(by_node: Sequence[dict[int, tuple[dict[str, dict], dict[str, int]]] | None]) -> Candidate | None:
    """The newest step whose recorded files (and meta) the nodes hold together with the recorded sizes, and the
    moves that give every node all of them: each missing file from the first node that holds it."""
    steps = sorted({s for held in by_node for s in (held or {})}, reverse=True)
    for step in steps:
        nodes = [held.get(step) if held else None for held in by_node]
        recorded_files = next(files for files, _ in (x for x in nodes if x is not None))
        want = {name: e.get("size") for name, e in recorded_files.items()}
        # the leaders' meta files differ in their commit time only: a node that lacks one gets the first holder's
        want[META] = next(x[1][META] for x in nodes if x is not None and META in x[1])
        moves, whole = [], True
        for name in sorted(want, key=lambda n: (n == META, n)):
            holders = [i for i, x in enumerate(nodes) if x is not None and (x[1].get(name) == want[name]
                                                                            or name == META and META in x[1])]
            if not holders:
                whole = False
                break
            moves += [(name, holders[0], i, want[name]) for i in range(len(nodes)) if i not in holders]
        if whole:
            return Candidate(step, moves)
    return None


def candidate(local: CheckpointDirs, nodes: Nodes, skip: Iterable[Path]) -> Candidate | None:
    """Collective: the newest local-tier checkpoint the nodes can restore together (not yet assembled)."""
    mine = holdings(local, skip) if nodes.is_leader else None
    everyone = gather(mine)
    return plan([everyone[r] for r in nodes.leaders])


def assemble(local: CheckpointDirs, nodes: Nodes, cand: Candidate) -> Path:
    """Collective: copy to each node what it lacks of ``cand`` (a node without the folder receives it into a partial
    folder, renamed once its meta arrived); returns the folder, the same path on every node."""
    final = local.final_path(cand.step)
    lacking = {to for _, _, to, _ in cand.moves}
    into = final
    if nodes.is_leader and nodes.node in lacking and not final.is_dir():
        into = local.begin(cand.step)
    if nodes.is_leader:
        transfer(nodes, cand.moves, source=final, target=into)
        if into != final:
            os.rename(into, final)
        (final / REPLICA_PARTIAL).unlink(missing_ok=True)  # every file it named was copied again, whole
    _barrier()
    return final


# -- moving files between nodes ----------------------------------------------------------------------------------------
def transfer(nodes: Nodes, moves: Sequence[Move], *, source: Path, target: Path, group: Any = None,
             moved: Callable[[int], None] | None = None, delay_s: float = 0.0) -> None:
    """Leaders only, every leader the same ``moves`` in the same order: the sending node reads ``source/name``, the
    receiving one writes ``target/name`` (through a temporary name, renamed when whole). ``group``: the leaders'
    group to use (default ``nodes.group``); ``moved(n)``: told after each chunk sent or received; ``delay_s``: a
    pause before each chunk sent (fault injection for tests: a slow network)."""
    if not moves:
        return
    import time

    import torch
    import torch.distributed as dist

    group = nodes.group if group is None else group
    buf = bytearray(CHUNK)
    for name, src, dst, size in moves:
        if nodes.node == src:
            with open(source / name, "rb", buffering=0) as f:
                left = size
                while left > 0:
                    n = f.readinto(memoryview(buf)[: min(left, CHUNK)])
                    if not n:
                        raise OSError(f"{source / name}: ended {left} bytes short of {size} while sending it")
                    if delay_s:
                        time.sleep(delay_s)
                    dist.send(torch.frombuffer(buf, dtype=torch.uint8, count=n), nodes.leaders[dst], group=group)
                    left -= n
                    if moved is not None:
                        moved(n)
        elif nodes.node == dst:
            path = target / name
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".incoming")
            with open(tmp, "wb") as f:
                left = size
                while left > 0:
                    t = torch.empty(min(left, CHUNK), dtype=torch.uint8)
                    dist.recv(t, nodes.leaders[src], group=group)
                    f.write(t.numpy().tobytes())
                    left -= t.numel()
                    if moved is not None:
                        moved(t.numel())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)


def _barrier() -> None:
    dist = live_dist()
    if dist is not None:
        dist.barrier()
