"""The one local-rank spawner (hpc_tools.testing.spawn) on tiny Python programs (no torch but in the port test,
~4 s in all).

Every rank gets exactly the environment the local executor gives its ranks (executors.local.rank_env); the first rank
to fail stops the others at once; a timeout stops all of them; rank 0 serves on the listening socket the spawner held
from the moment it chose the port.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from hpc_tools.executors.local import SLURM_STEP_VARS, rank_env
from hpc_tools.testing.spawn import RanksFailed, spawn_ranks

SHOWN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
         "HPC_TOOLS_EXECUTOR", "SLURM_JOB_ID", "SPAWN_EXTRA")
SHOW_ENV = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {SHOWN!r}}}))"


def test_rank_env_is_the_local_executors():
    env = rank_env(2, 4, 12345, {"SPAWN_EXTRA": "x"}, base={"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "PATH": "/bin"})
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} \
        == {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "12345"}
    assert env["OMP_NUM_THREADS"] == "1" and env["SPAWN_EXTRA"] == "x" and env["PATH"] == "/bin"
    assert not set(SLURM_STEP_VARS) & set(env)
    assert rank_env(0, 1, 1, base={"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"  # a set value stands


def test_every_rank_gets_its_environment(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "99")  # as when the tests run inside an allocation: not a Slurm step
    ranks = spawn_ranks([sys.executable, "-c", SHOW_ENV], 3, env={"SPAWN_EXTRA": "yes"}, timeout_s=60, check=True)
    seen = [json.loads(r.log) for r in ranks]
    assert [(s["RANK"], s["LOCAL_RANK"]) for s in seen] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert {(s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["MASTER_ADDR"], s["MASTER_PORT"]) for s in seen} == \
        {("3", "3", "127.0.0.1", seen[0]["MASTER_PORT"])}
    assert all(s["HPC_TOOLS_EXECUTOR"] == "local" and s["SPAWN_EXTRA"] == "yes" and s["SLURM_JOB_ID"] is None
               for s in seen)
    assert all(r.ok and r.returncode == 0 for r in ranks)


def test_first_failure_stops_the_others(tmp_path):
    # rank 1 fails only once the others have written their line: on a loaded machine a rank's interpreter can
    # start after rank 1 has already failed, and be stopped before it prints anything
    code = ("import os, sys, time, pathlib; r = int(os.environ['RANK']); print('rank', r, flush=True); "
            f"logs = [pathlib.Path({str(tmp_path)!r}) / f'rank{{i}}.log' for i in (0, 2)]; "
            "[time.sleep(0.05) for _ in range(1200) if r == 1 and not all("
            "p.exists() and p.read_text().strip() for p in logs)]; "
            "sys.exit(3) if r == 1 else time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(RanksFailed, match=r"rank 1 exited 3 first") as failed:
        spawn_ranks([sys.executable, "-c", code], 3, timeout_s=60, log_dir=tmp_path, check=True)
    assert time.monotonic() - t0 < 30, "the sleeping ranks must be stopped, not waited for"
    ranks = failed.value.ranks
    assert failed.value.culprit == 1 and ranks[1].returncode == 3 and ranks[1].log.strip() == "rank 1"
    assert ranks[0].returncode < 0 and ranks[2].returncode < 0  # stopped by a signal
    assert (tmp_path / "rank2.log").read_text().strip() == "rank 2"  # log_dir keeps the logs


def test_timeout_stops_every_rank():
    ranks = spawn_ranks([sys.executable, "-c", "import time; time.sleep(60)"], 2, timeout_s=1)
    assert all(r.timed_out and not r.ok and r.returncode < 0 for r in ranks)


def test_rank_0_gets_the_held_socket_of_master_port_and_serves_the_store_on_it():
    code = ("import os, socket; from datetime import timedelta; "
            "from hpc_tools.runtime.distenv import STORE_FD_ENV, DistEnv, rendezvous_store; "
            "held = socket.socket(fileno=os.dup(int(os.environ[STORE_FD_ENV]))); "
            "print('held', held.getsockname()[1], 'master', os.environ['MASTER_PORT']); "
            "s = rendezvous_store(DistEnv.from_environ(), timedelta(seconds=60)); s.set('k', 'v'); "
            "print('served', s.get('k').decode())")
    [rank] = spawn_ranks([sys.executable, "-c", code], 1, timeout_s=120, check=True)
    words = rank.log.split()
    assert words[words.index("held") + 1] == words[words.index("master") + 1] and words[-1] == "v", rank.log


def test_a_rank_that_binds_master_port_itself_is_told_to_join_through_join_world():
    code = ("import os, torch.distributed as d; "
            "d.TCPStore('127.0.0.1', int(os.environ['MASTER_PORT']), 1, True, wait_for_workers=False)")
    with pytest.raises(RanksFailed, match="bound MASTER_PORT itself.*join_world"):
        spawn_ranks([sys.executable, "-c", code], 1, timeout_s=120, check=True)
