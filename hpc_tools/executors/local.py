"""The local executor: one process per rank on this machine (CPU + gloo, or local GPUs), like srun would start.

Each rank runs ``python -m hpc_tools.runtime.rank --run-dir RUN`` with torchrun-style variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT). CPU ranks are forked from one process that imported torch and the backend's library
once (``hpc_tools.runtime.forkserver``; ``HPC_TOOLS_FORKSERVER=0``: each starts its own interpreter, as GPU ranks
always do). Rank 0's output goes to the console and every rank's to ``logs/rank<R>.out``; when one
rank fails the others are stopped, as ``srun --kill-on-bad-exit`` does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from hpc_tools.registry import RunFolder, now_iso
from hpc_tools.runtime import forkserver
from hpc_tools.runtime.distenv import STORE_FD_ENV, free_port, listening_socket

LOCAL_ADDR = "127.0.0.1"
# Set when this process runs inside a Slurm allocation: a local rank is not a Slurm step and must not look like one.
SLURM_STEP_VARS = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST")


def rank_env(rank: int, world_size: int, port: int, extra: Mapping[str, str] | None = None,
             base: Mapping[str, str] | None = None, store_fd: int | None = None) -> dict[str, str]:
    """The environment local rank ``rank`` of ``world_size`` starts with: the one owner of what a local rank gets.

    ``base`` (default: this process's environment) without the Slurm step variables, torchrun-style rendezvous on
    127.0.0.1:``port``, one OpenMP thread unless OMP_NUM_THREADS is already set (ranks share this machine's cores),
    unbuffered output, then ``extra``, then the rank's own RANK / LOCAL_RANK, and for rank 0 the held rendezvous
    socket ``store_fd`` (``distenv.listening_socket``; the caller passes it with ``pass_fds``). Used by ``run_local``
    and by the test harnesses' spawner (``hpc_tools.testing.spawn``).
    """
    source = os.environ if base is None else base
    env = {**source, "MASTER_ADDR": LOCAL_ADDR, "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "HPC_TOOLS_EXECUTOR": "local", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": source.get("OMP_NUM_THREADS", "1"), **(extra or {})}
    for key in SLURM_STEP_VARS:
        env.pop(key, None)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    if rank == 0 and store_fd is not None:
        env[STORE_FD_ENV] = str(store_fd)
    return env


def rank_command(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hpc_tools.runtime.rank", "--run-dir", str(run_dir), *args]


def fork_preload(run: RunFolder, argv: list[str]) -> tuple[str, ...] | None:
    """What the fork server imports before forking this run's ranks (``hpc_tools.runtime.forkserver``), or None
    where each rank starts its own interpreter (GPU ranks, ``HPC_TOOLS_FORKSERVER=0``)."""
    from hpc_tools import backends
    from hpc_tools.recipe.load import load_resolved

    recipe = load_resolved(run.recipe_path)
    if not forkserver.usable(argv, recipe.cluster.uses_gpus):
        return None
    return backends.rank_preload(recipe.backend.kind)


def _pump(src: IO[bytes], sinks: list[IO[bytes]]) -> None:
    for line in iter(src.readline, b""):
        for sink in sinks:
            sink.write(line)
            sink.flush()


def run_local(run: RunFolder, world_size: int, echo: IO[bytes] | None = None, extra_env: dict[str, str] | None = None,
              poll_s: float = 0.2, rank_args: tuple[str, ...] = ()) -> int:
    """Run all ranks to completion; returns the first non-zero rank exit code, or 0. With ``cluster.restarts``, ranks
    that fail are started again from the newest complete checkpoint while the budget lasts
    (``hpc_tools.job.restarts.local_restart``, recorded in the manifest's ``restarts``). ``rank_args``: more
    arguments of the rank program (``--preflight-only``: ``hpc_tools preflight``)."""
    from hpc_tools.job.restarts import local_restart
    from hpc_tools.render.launchers import of as launcher_row
    from hpc_tools.runtime.distenv import RESTART_BASE_ENV

    if launcher_row(launcher(run)).driver and not rank_args:  # one process drives every rank (Ray)
        return run_ray_local(run, world_size, echo, extra_env)
    extra_env = dict(extra_env or {})
    while True:
        code, first_failed = _run_ranks(run, world_size, echo, extra_env, poll_s, rank_args)
        if code in (0, 130):
            break
        start = int(extra_env.get(RESTART_BASE_ENV, os.environ.get(RESTART_BASE_ENV, "0")) or 0)
        new = local_restart(run, first_failed, start)
        if new is None:
            break
        extra_env[RESTART_BASE_ENV] = str(new)
    if code == 130:
        run.update(event="failed", state="CANCELLED", ended=now_iso(), exit_code=code, soft=True)
    else:  # the same record as the batch script's epilogue: state, exit code, failed ranks, reason
        from hpc_tools.job.epilogue import failures_from_exit_codes, record_end

        record_end(run, _shell_status(code), failures_from_exit_codes(first_failed))
    return code


def launcher(run: RunFolder) -> str:
    """The run's ``cluster.launcher`` (its resolved recipe names every field)."""
    from hpc_tools.recipe.yamlfile import parse_yaml

    cluster = parse_yaml(run.recipe_path.read_text(), str(run.recipe_path)).get("cluster") or {}
    return cluster.get("launcher") or "srun"


def run_ray_local(run: RunFolder, world_size: int, echo: IO[bytes] | None = None,
                  extra_env: dict[str, str] | None = None) -> int:
    """``cluster.launcher: ray`` on this machine: the Ray driver (``hpc_tools.job.ray_launch``) in a process of its
    own, which starts a one-node Ray (``cluster.cpus_per_task`` CPUs per rank) and runs every rank under Ray Train;
    its output goes to the console and ``logs/ray_driver.out``. Ray Train restarts failed ranks
    (``cluster.restarts``), so no local restart loop runs here. The control plane never imports Ray: only that
    process does."""
    from hpc_tools.job.epilogue import record_end

    run.update(event="launched", state="RUNNING", executor="local", launcher="ray", launched=now_iso(),
               world_size=world_size)
    env = rank_env(0, world_size, free_port(), extra_env)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key)  # Ray Train gives each worker its own
    cmd = [sys.executable, "-m", "hpc_tools.job.ray_launch", "drive", "--run-dir", str(run.path)]
    with open(run.logs_dir / "ray_driver.out", "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        run.update(pids=[proc.pid])  # `hpc_tools cancel` signals this process group
        pump = threading.Thread(target=_pump, args=(proc.stdout, [log] + ([echo] if echo is not None else [])),
                                daemon=True)
        pump.start()
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            stop_ranks([proc])
            code = 130
        finally:
            end_groups([proc])
            pump.join(timeout=5)
    if code == 130:
        run.update(event="failed", state="CANCELLED", ended=now_iso(), exit_code=code, soft=True)
    else:
        record_end(run, _shell_status(code), [])
    return code


def _run_ranks(run: RunFolder, world_size: int, echo: IO[bytes] | None, extra_env: dict[str, str],
               poll_s: float, rank_args: tuple[str, ...] = ()) -> tuple[int, dict[int, int]]:
    """One start of every rank: (the first non-zero exit code or 0, the first failing ranks' return codes)."""
    listener = listening_socket(LOCAL_ADDR)  # held from here to rank 0's store: no other process can take the port
    port = listener.getsockname()[1]
    run.update(event="launched", state="RUNNING", executor="local", launched=now_iso(), world_size=world_size)
    argv = rank_command(run.path, *rank_args)
    preload = fork_preload(run, argv)
    pumps = []
    logs = [open(run.logs_dir / f"rank{rank:05d}.out", "ab") for rank in range(world_size)]  # before the ranks look
    with listener:
        envs = [rank_env(rank, world_size, port, extra_env, store_fd=listener.fileno()) for rank in range(world_size)]
        if preload is not None:  # CPU ranks: forked from one process that imported their libraries once
            procs: list = forkserver.start(argv, envs, [None] * world_size, preload=preload,
                                           rank0_fds=(listener.fileno(),))
        else:
            procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True, pass_fds=(listener.fileno(),) if rank == 0 else ())
                     for rank, env in enumerate(envs)]
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            sinks = [log] + ([echo] if echo is not None and rank == 0 else [])
            pump = threading.Thread(target=_pump, args=(proc.stdout, sinks), daemon=True)
            pump.start()
            pumps.append(pump)
    run.update(pids=[p.pid for p in procs])  # `hpc_tools cancel` signals these process groups
    code, first_failed = 0, {}
    try:
        while [p.poll() for p in procs].count(None):  # poll every rank: a short-circuit leaves return codes unread
            first_failed = {r: p.returncode for r, p in enumerate(procs) if p.returncode not in (None, 0)}
            if first_failed:
                code = next(iter(first_failed.values()))
                stop_ranks(procs)
                break
            time.sleep(poll_s)
        if not first_failed:  # every rank exited by itself: the failing ones (if any) are the culprits
            first_failed = {r: p.returncode for r, p in enumerate(procs) if p.returncode}
        code = code or next(iter(first_failed.values()), 0)
    except KeyboardInterrupt:
        stop_ranks(procs)
        code = 130
    finally:
        end_groups(procs)
        for pump in pumps:
            pump.join(timeout=5)
        for log in logs:
            log.close()
    return code, first_failed


def end_groups(procs: list[subprocess.Popen]) -> None:
    """SIGKILL what is left in the process group of each rank that has exited: the children it forked (a checkpoint
    writer, a data worker) outlive a rank killed with SIGKILL, holding CPU, memory and the rank's output pipe; as
    Slurm ends a step's cgroup, the local executor ends its ranks' groups."""
    for p in procs:
        if p.poll() is None or not p.pid:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def _shell_status(returncode: int) -> int:
    """A Popen return code as a shell reports it (killed by signal 9: -9 -> 137)."""
    return 128 - returncode if returncode < 0 else returncode


def stop_ranks(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every running rank's process group (started with ``start_new_session``), SIGKILL after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
