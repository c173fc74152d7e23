"""The local launcher's rendezvous port is never free for another process to take (``distenv.listening_socket`` and
``rendezvous_store``): the launcher holds it listening from the moment it is chosen, rank 0's store serves on that very
socket, and the other ranks reach it. With ``free_port`` the port was let go and rank 0 bound it again a second or two
later, after its Python and torch had started: a process of the machine could take it in between, and the run failed
at its start (EADDRINUSE)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest

from hpc_tools.runtime.distenv import STORE_FD_ENV, listening_socket

pytest.importorskip("torch.distributed")

RANK = """
import os, sys
from datetime import timedelta
from hpc_tools.runtime.distenv import DistEnv, STORE_FD_ENV, rendezvous_store
rank = int(sys.argv[1])
d = DistEnv(rank=rank, world_size=2, local_rank=rank, local_world_size=2, node_rank=0, master_addr="127.0.0.1",
            master_port=int(sys.argv[2]), job_id=None, restart_count=0, executor="local")
store = rendezvous_store(d, timedelta(seconds=30))
assert STORE_FD_ENV not in os.environ  # taken: the processes this rank starts do not inherit the claim
store.set(f"rank{rank}", "here")
print(store.get(f"rank{1 - rank}").decode())
"""


def test_the_port_is_held_until_rank_0_serves_on_it_and_the_ranks_meet_there():
    listener = listening_socket()
    port = listener.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError) as taken:  # another process's bind in the meantime
        other.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    env = {**os.environ, STORE_FD_ENV: str(listener.fileno())}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port)], stdout=subprocess.PIPE, text=True,
                              env=env if r == 0 else os.environ, pass_fds=(listener.fileno(),) if r == 0 else ())
             for r in (1, 0)]  # rank 1 first: it connects to the held socket before rank 0 serves on it
    listener.close()
    out = [p.communicate(timeout=120)[0].strip() for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0] and out == ["here", "here"], out


def test_without_a_socket_rank_0_binds_the_port_itself_as_env_rendezvous_does():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != STORE_FD_ENV}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port)], stdout=subprocess.PIPE, text=True,
                              env=env) for r in (0, 1)]
    out = [p.communicate(timeout=120)[0].strip() for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0] and out == ["here", "here"], out
