"""Rank, world and rendezvous from the launcher's environment: Slurm's srun (SLURM_*) or the local launcher (RANK...).

Who decides the rendezvous (MASTER_ADDR, MASTER_PORT):
- Slurm jobs: ``slurm_rendezvous`` here: the first host of SLURM_JOB_NODELIST and a port derived from the job id.
  The rendered sbatch script exports it before ``srun`` by running ``python -m hpc_tools.runtime.distenv``; under
  submitit (no script) every rank computes the same values in ``DistEnv.from_environ``.
- Local runs: ``hpc_tools.executors.local`` opens a listening socket on 127.0.0.1 (``listening_socket``), passes its
  port to every rank and the socket itself to rank 0 (``HPC_TOOLS_STORE_FD``), whose store serves on it
  (``rendezvous_store``); ``DistEnv.from_environ`` reads them back. A port chosen and let go first (``free_port``)
  could be taken by any process of the machine before rank 0, a second or two later, bound it.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
from dataclasses import dataclass

PORT_BASE, PORT_SPAN = 20000, 20000
STORE_FD_ENV = "HPC_TOOLS_STORE_FD"
"""Rank 0's inherited listening socket (its file descriptor), where the local executor opened it: the store serves
on it."""
# Starts of the run before this job (set by `python -m hpc_tools resume`): a resumed job's restarts count on from them.
RESTART_BASE_ENV = "HPC_TOOLS_RESTART_BASE"


def first_host(nodelist: str) -> str:
    """First hostname of a Slurm nodelist; `scontrol show hostnames` when available, else a small parser."""
    from hpc_tools import slurm_client

    hosts = slurm_client.hostnames(nodelist, timeout=10)
    return hosts[0] if hosts else expand_first(nodelist)


def expand_first(nodelist: str) -> str:
    """``node[03-05,7],gpu1`` -> ``node03`` (leading zeros kept)."""
    head = re.split(r",(?![^\[]*\])", nodelist)[0]
    m = re.match(r"^([^\[]*)\[([^\],-]+)", head)
    return m.group(1) + m.group(2) if m else head


def port_for_job(job_id: str | int | None) -> int:
    """A rendezvous port derived from the job id, so concurrent jobs sharing a node do not collide."""
    if job_id is None:
        return free_port()
    return PORT_BASE + int(str(job_id).split("_")[0]) % PORT_SPAN


def slurm_rendezvous(env: dict[str, str]) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) of a Slurm job: the first node of its step (of the job in the batch shell; they
    differ when the job holds spare nodes, ``cluster.spare_nodes``) and a port derived from its job id."""
    nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    return first_host(nodes), port_for_job(env.get("SLURM_JOB_ID"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_socket(addr: str = "127.0.0.1") -> socket.socket:
    """A socket listening on a port the kernel chose, inheritable: the launcher keeps the port from the moment it is
    chosen and hands the socket to rank 0 (``pass_fds`` and ``STORE_FD_ENV``), where ``rendezvous_store`` serves on
    it."""
    sock = socket.socket()
    sock.bind((addr, 0))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def rendezvous_store(d: "DistEnv", timeout):
    """The job's TCPStore, as torch.distributed's env:// rendezvous makes it (rank 0 serves at MASTER_ADDR:PORT, the
    others connect; multi-tenant), except that rank 0 serves on the socket its launcher opened when it was given one
    (``STORE_FD_ENV``, taken from the environment here: the processes this rank starts do not inherit the claim)."""
    import torch.distributed as dist

    fd = os.environ.pop(STORE_FD_ENV, None) if d.rank == 0 else None
    listen = {"master_listen_fd": int(fd)} if fd else {}
    return dist.TCPStore(d.master_addr, d.master_port, d.world_size, d.rank == 0, timeout=timeout,
                         wait_for_workers=False, multi_tenant=True, **listen)


def join_world(backend: str, d: "DistEnv | None" = None, timeout=None) -> "DistEnv":
    """torch.distributed's default process group of this rank (``d``, default: from the environment), as
    ``init_process_group(backend)`` with env:// makes it (its store behind the "default_pg" prefix), through
    ``rendezvous_store``: the one way every rank joins, a trainer's or a test harness's."""
    import torch.distributed as dist

    d = d or DistEnv.from_environ()
    store = rendezvous_store(d, timeout or dist.constants.default_pg_timeout)
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=d.rank,
                            world_size=d.world_size, **({"timeout": timeout} if timeout else {}))
    return d


def restart_count(env: dict[str, str]) -> int:
    """This start's number within the run (the records' ``restart``): Slurm's requeue count (SLURM_RESTART_COUNT) on
    top of the starts before this job (``HPC_TOOLS_RESTART_BASE``, which ``hpc_tools resume`` sets)."""
    return int(env.get("SLURM_RESTART_COUNT", "0") or 0) + int(env.get(RESTART_BASE_ENV, "0") or 0)


@dataclass(frozen=True, slots=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    job_id: str | None
    restart_count: int
    executor: str

    @classmethod
    def from_environ(cls, env: dict[str, str] | None = None) -> "DistEnv":
        env = dict(os.environ if env is None else env)
        job_id = env.get("SLURM_ARRAY_JOB_ID") and f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}" \
            or env.get("SLURM_JOB_ID")
        restarts = restart_count(env)
        if "RANK" in env and "WORLD_SIZE" in env:  # local launcher or torchrun
            return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                       local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                       local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                       node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))),
                       master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(env.get("MASTER_PORT", "29500")),
                       job_id=job_id, restart_count=restarts, executor=env.get("HPC_TOOLS_EXECUTOR", "local"))
        if "SLURM_PROCID" in env:
            ntasks = int(env["SLURM_NTASKS"])
            nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
            # The sbatch script exported the rendezvous already; under submitit each rank derives the same one.
            addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
            if not (addr and port):
                derived = slurm_rendezvous(env)
                addr, port = addr or derived[0], port or derived[1]
            return cls(rank=int(env["SLURM_PROCID"]), world_size=ntasks, local_rank=int(env.get("SLURM_LOCALID", "0")),
                       local_world_size=ntasks // max(nodes, 1), node_rank=int(env.get("SLURM_NODEID", "0")),
                       master_addr=addr, master_port=int(port),
                       job_id=job_id, restart_count=restarts, executor=env.get("HPC_TOOLS_EXECUTOR", "slurm"))
        return cls(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, master_addr="127.0.0.1",
                   master_port=free_port(), job_id=job_id, restart_count=restarts, executor="local")

    def export(self) -> None:
        """Set the variables torch.distributed's env:// rendezvous and DeepSpeed read."""
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                           "LOCAL_RANK": str(self.local_rank),
                           "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                           "MASTER_PORT": str(self.master_port)})


def main(env: dict[str, str] | None = None) -> int:
    """Print the Slurm job's rendezvous as shell exports, for the batch script to ``eval`` before ``srun``.

    Values inherited from the submitting shell are ignored: the allocation decides.
    """
    env = dict(os.environ if env is None else env)
    if "SLURM_JOB_NODELIST" not in env:
        print("error: python -m hpc_tools.runtime.distenv runs inside a Slurm job (SLURM_JOB_NODELIST is not set)",
              file=sys.stderr)
        return 2
    addr, port = slurm_rendezvous(env)
    print(f"export MASTER_ADDR={shlex.quote(addr)} MASTER_PORT={port}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
