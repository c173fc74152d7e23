"""The node-local tier's replication in the background (``checkpoint.local_replicate``, docs/checkpoints.md): after
a local save is committed, each node's leader copies its node's files to the next node's folder in a thread, while
every rank goes on training.

    Replicator.of(ctx, nodes)   collective, once per run (the saver's construction): a gloo group of the leaders of
                                its own, on ``checkpoint.local_replicate_interface`` when set (GLOO_SOCKET_IFNAME while
                                the group is made), with a timeout (``stall_s``) that bounds every send and receive
    start(step, folder, moves)  leaders, right after their commit: a thread that walks ``moves`` (node_tier.transfer);
                                the receiving side writes ``REPLICA_PARTIAL`` first and renames it
                                ``REPLICA_COMPLETE`` once every file is whole and fsynced
    wait(progress)              leaders, before the next local commit (whose prune could remove the folder) and at the
                                end of training: the replica's outcome; a replication that moves no byte for
                                ``stall_s`` is given up (its thread stops at its next chunk, the replica stays
                                partial)

The thread issues no collective on the run's groups (only point-to-point on its own group), so the training's
collectives never interleave with it. A process that dies during a replication leaves the partial marker: that
replica is never used for recovery (``node_tier.holdings``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from hpc_tools.train.checkpointing import node_tier
from hpc_tools.train.checkpointing.agree import gather, live_dist

if TYPE_CHECKING:
    from hpc_tools.runtime.context import RankContext

INJECT_DELAY_ENV = "HPC_TOOLS_INJECT_REPLICATE_DELAY_S"
"""Fault injection for tests only: seconds the sending leader pauses before each chunk (a slow network)."""
DEFAULT_STALL_S = 1800.0
"""A replication that moves no byte for this long is given up, without a hang watchdog (torch's default timeout)."""


@dataclass
class Outcome:
    """How one leader's part of a replication ended (``wait``)."""

    step: int
    node: int
    bytes: int
    seconds: float
    error: str | None = None


class Replication:
    """One local save's replica on this leader: a daemon thread that sends this node's files and receives the
    previous node's (``node_tier.transfer``)."""

    def __init__(self, nodes: node_tier.Nodes, group: Any, step: int, folder: Path, moves: Sequence[node_tier.Move]):
        self.nodes, self.group, self.step, self.folder, self.moves = nodes, group, step, folder, list(moves)
        self.moved = 0
        self.error: str | None = None
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        self.delay_s = float(os.environ.get(INJECT_DELAY_ENV) or 0.0)
        self.cancelled = threading.Event()  # given up (``Replicator.wait``): the thread stops at its next chunk
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"ckpt-replica-{step}")

    def _count(self, n: int) -> None:
        self.moved += n
        if self.cancelled.is_set():
            raise RuntimeError(f"replication of step {self.step} given up")

    def _run(self) -> None:
        incoming = {name: size for name, _, dst, size in self.moves if dst == self.nodes.node}
        partial = self.folder / node_tier.REPLICA_PARTIAL
        try:
            if incoming:
                src = next(s for _, s, d, _ in self.moves if d == self.nodes.node)
                _write_synced(partial, {"from_node": src, "files": incoming})
            node_tier.transfer(self.nodes, self.moves, source=self.folder, target=self.folder, group=self.group,
                               moved=self._count, delay_s=self.delay_s)
            if incoming:
                _fsync_dir(self.folder)
                done = {"from_node": src, "files": incoming, "bytes": sum(incoming.values()),
                        "seconds": round(time.perf_counter() - self.t0, 3)}
                _write_synced(partial, done)
                os.replace(partial, self.folder / node_tier.REPLICA_COMPLETE)
                _fsync_dir(self.folder)
        except BaseException as e:  # noqa: BLE001 - a thread's error is reported by wait(), never raised here
            self.error = (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0][:300]
        finally:
            self.seconds = time.perf_counter() - self.t0

    def outcome(self) -> Outcome:
        return Outcome(self.step, self.nodes.node, self.moved, self.seconds or time.perf_counter() - self.t0,
                       self.error)


class Replicator:
    """The replications of one run on one rank (leaders do the work; every rank holds one, so that ``of`` and the
    saver's gather of outcomes stay collective)."""

    def __init__(self, nodes: node_tier.Nodes, group: Any, stall_s: float, key: tuple | None = None):
        self.nodes, self.group, self.stall_s, self.key = nodes, group, stall_s, key
        self.current: Replication | None = None

    @classmethod
    def of(cls, ctx: "RankContext", nodes: node_tier.Nodes) -> "Replicator":
        """Collective (every rank, the same call order): the leaders' replication group, made once per process,
        nodes and interface. ``checkpoint.local_replicate_interface`` that names an interface a node lacks: one line
        (``UserError``) on every rank, before any group is made."""
        from datetime import timedelta

        from hpc_tools.errors import UserError

        interface = getattr(ctx.recipe.checkpoint, "local_replicate_interface", None)
        hang_min = getattr(getattr(ctx.recipe, "cluster", None), "hang_timeout_min", 0) or 0
        stall_s = hang_min * 60 if hang_min > 0 else DEFAULT_STALL_S
        missing = [w for w in gather(missing_interface(interface) if nodes.is_leader else None) if w]
        if missing:
            raise UserError(f"checkpoint.local_replicate_interface={interface}: {missing[0]} (set it to an interface "
                            "every node has, e.g. the one `ip -br addr` shows on the compute network, or remove it "
                            "to use the one the host name resolves to)")
        key = (id(nodes), interface, stall_s)
        if key not in _GROUPS:
            dist = live_dist()
            group = None
            if dist is not None and nodes.count > 1:
                saved = os.environ.get("GLOO_SOCKET_IFNAME")
                if interface:
                    os.environ["GLOO_SOCKET_IFNAME"] = interface  # read by gloo when the group's device is made
                try:
                    group = dist.new_group(ranks=nodes.leaders, backend="gloo", timeout=timedelta(seconds=stall_s))
                finally:
                    if saved is None:
                        os.environ.pop("GLOO_SOCKET_IFNAME", None)
                    else:
                        os.environ["GLOO_SOCKET_IFNAME"] = saved
            _GROUPS[key] = group
        return cls(nodes, _GROUPS[key], stall_s, key)

    def retire(self) -> None:
        """Every rank, once a replication failed or stalled: this group is not used again (an abandoned thread
        may still hold it); a later ``of`` makes a new one."""
        _GROUPS.pop(self.key, None)

    def start(self, step: int, folder: Path, moves: Sequence[node_tier.Move]) -> None:
        """Leaders, right after committing ``folder``: replicate ``moves`` in the background (after ``wait``)."""
        if not self.nodes.is_leader or not moves:
            return
        self.current = Replication(self.nodes, self.group, step, folder, moves)
        self.current.thread.start()

    def wait(self, progress: Callable[[], None] = lambda: None) -> Outcome | None:
        """Leaders: the outcome of the running replication once it ended (None when none ran); ``progress`` is
        called while it moves bytes (the hang watchdog's clock of the save). One that moves no byte for ``stall_s``
        is given up: an ``Outcome`` with the error, its thread told to stop at its next chunk and left behind (a
        daemon; its folder's marker stays partial)."""
        r, self.current = self.current, None
        if r is None:
            return None
        seen, since = -1, time.monotonic()
        while r.thread.is_alive():
            if r.moved != seen:
                seen, since = r.moved, time.monotonic()
            elif time.monotonic() - since > self.stall_s:
                r.cancelled.set()
                out = r.outcome()
                out.error = f"no byte moved for {self.stall_s:.0f} s ({r.moved} bytes moved in all)"
                return out
            progress()
            r.thread.join(0.05)
        return r.outcome()


_GROUPS: dict[tuple[int, str | None, float], Any] = {}


def missing_interface(interface: str | None) -> str | None:
    """Why this node cannot replicate over ``interface`` (GLOO_SOCKET_IFNAME's form: names, comma-separated), or
    None."""
    if not interface:
        return None
    import socket

    have = [name for _, name in socket.if_nameindex()]
    absent = [n for n in interface.split(",") if n not in have]
    if absent:
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        return f"node {node} has no interface {absent[0]} (it has {', '.join(have)})"
    return None


def _write_synced(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(record, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
