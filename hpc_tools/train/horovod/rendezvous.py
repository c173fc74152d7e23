"""Horovod's gloo rendezvous as ``horovodrun --gloo`` sets it up, without ssh and without horovodrun.

``horovodrun --gloo`` (``horovod/runner/gloo_run.py``) starts an HTTP ``RendezvousServer`` on the launching host,
tells it every slot (host, rank, local and cross rank: ``init(host_alloc_plan)``), and starts each rank over ssh with
``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT``, ``HOROVOD_CONTROLLER=gloo``, ``HOROVOD_CPU_OPERATIONS=gloo``,
``HOROVOD_HOSTNAME`` and ``HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/CROSS_RANK/CROSS_SIZE``. Here the ranks are already
started, by srun on Slurm or by the local executor, the same way as every backend's, and have joined
torch.distributed (the loop's process group); ``join`` then does the rest over it: every rank's node name
(``runtime.heartbeat.node_name``) is gathered, rank 0 starts the server on its host (the job's MASTER_ADDR: the first
node of the step) and broadcasts its port, and every rank sets the variables above for its slot and calls
``hvd.init()``. Most Slurm sites forbid ssh between nodes; nothing here needs it.

The slots follow ``horovod.runner.common.util.hosts.get_host_assignments``: local rank = the rank's place among the
ranks of its host, cross rank = the host's place among the hosts that have that local rank (in rank order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpc_tools.runtime.heartbeat import node_name

if TYPE_CHECKING:
    from hpc_tools.runtime.context import RankContext

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Slot:
    """One rank's place, as Horovod's ``SlotInfo`` holds it."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def slots(hosts: list[str]) -> list[Slot]:
    """Every rank's slot from every rank's host name (``hosts[rank]``)."""
    local: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        local.setdefault(host, []).append(rank)
    cross: dict[int, list[str]] = {}  # local rank -> the hosts that have it, in order
    for host, ranks in local.items():
        for i in range(len(ranks)):
            cross.setdefault(i, []).append(host)
    out = []
    for rank, host in enumerate(hosts):
        i = local[host].index(rank)
        out.append(Slot(hostname=host, rank=rank, local_rank=i, cross_rank=cross[i].index(host), size=len(hosts),
                        local_size=len(local[host]), cross_size=len(cross[i])))
    return out


def environment(slot: Slot, addr: str, port: int, fusion_mb: int, timeout_s: int | None = None,
                iface: str = "") -> dict[str, str]:
    """The variables ``hvd.init()`` reads for ``slot``, with the rendezvous server at ``addr:port``: horovodrun
    --gloo's (``gloo_run.create_slot_env_vars`` and ``create_run_env_vars``), plus the fusion buffer in bytes, the gloo
    timeout (the recipe's collective timeout, so that the hang watchdog fires first) and the interface (gloo's
    ``GLOO_SOCKET_IFNAME``, the one torch.distributed uses: ``cluster.setup.env``)."""
    env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
           "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_HOSTNAME": slot.hostname,
           "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
           "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
           "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size),
           "HOROVOD_FUSION_THRESHOLD": str(fusion_mb * MIB)}
    if timeout_s:
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(timeout_s)
    if iface:
        env["HOROVOD_GLOO_IFACE"] = iface
    return env


class Rendezvous:
    """Horovod joined on this rank (``hvd``: ``horovod.torch``); rank 0 also holds the rendezvous server."""

    def __init__(self, hvd: Any, server: Any = None):
        self.hvd, self.server = hvd, server

    def close(self) -> None:
        """Leave Horovod (every rank at the same point) and stop the server."""
        self.hvd.shutdown()
        if self.server is not None:
            self.server.stop()
            self.server = None


def join(ctx: "RankContext") -> Rendezvous:
    """Collective over torch.distributed (already joined): Horovod's rendezvous for this job, then ``hvd.init()``."""
    import torch.distributed as dist

    hosts: list[Any] = [None] * ctx.dist.world_size
    dist.all_gather_object(hosts, node_name())  # Slurm's node name (SLURMD_NODENAME), else the host name
    mine = slots(hosts)
    server, port = None, [0]
    if ctx.is_rank0:
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousServer

        server = RendezvousServer()
        port[0] = server.start()
        server.init([SlotInfo(hostname=s.hostname, rank=s.rank, local_rank=s.local_rank, cross_rank=s.cross_rank,
                              size=s.size, local_size=s.local_size, cross_size=s.cross_size) for s in mine])
    dist.broadcast_object_list(port, src=0)
    timeout = ctx.collective_timeout
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    os.environ.update(environment(mine[ctx.rank], ctx.dist.master_addr, port[0],
                                  ctx.recipe.backend.horovod.fusion_threshold_mb,
                                  int(timeout.total_seconds()) if timeout else None, iface))
    import horovod.torch as hvd

    hvd.init()
    if (hvd.rank(), hvd.size()) != (ctx.rank, ctx.dist.world_size):
        raise RuntimeError(f"Horovod joined as rank {hvd.rank()} of {hvd.size()}, torch.distributed as rank "
                           f"{ctx.rank} of {ctx.dist.world_size}")
    return Rendezvous(hvd, server)
