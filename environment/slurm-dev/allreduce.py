"""One rank of a gloo all_reduce across Slurm tasks (run under `srun`); used by selftest.sh.

MASTER_ADDR is the first host of the job's node list, MASTER_PORT a fixed port.
"""

import os
import socket
import subprocess

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    os.environ.setdefault("MASTER_ADDR", hosts[0])
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert t.item() == expected, (t.item(), expected)
    if rank == 0:
        print(f"sum {t.item():g} (expected {expected:g}) world {world} hosts {','.join(hosts)}"
              f" master {os.environ['MASTER_ADDR']}", flush=True)
    print(f"rank {rank} on {socket.gethostname()} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
