"""The one local multi-rank spawner of the tests and benchmarks: ``argv`` once per rank, as the local executor would.

Every rank gets the environment the local executor gives its ranks (``hpc_tools.executors.local.rank_env``: RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, ...), plus this repository on PYTHONPATH so
``python -m hpc_tools.testing.<harness>`` resolves. Like ``srun --kill-on-bad-exit``, the first rank that fails, or the
timeout, stops all the others. The rendezvous port is held from its choice, as the local executor holds it: rank 0
gets the listening socket (``distenv.listening_socket``), so the ranks join with ``distenv.join_world`` (a rank that
bound MASTER_PORT itself would find it taken). Each rank's stdout and stderr go to one log file, read back into the
result. On a CPU build of torch the ranks are forked from one process that imported torch once
(``hpc_tools.runtime.forkserver``), as the local executor starts its CPU ranks::

    ranks = spawn_ranks([sys.executable, "-m", "hpc_tools.testing.workload", "comm", "--out", out], 2, check=True)
    ranks[0].log  # rank 0's output
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_tools.executors.local import end_groups, rank_env, stop_ranks
from hpc_tools.runtime import forkserver
from hpc_tools.runtime.distenv import listening_socket

REPO = Path(__file__).resolve().parents[2]
SPAWN_PRELOAD = ("torch",)
"""What the fork server imports for a harness's ranks on a CPU torch (``hpc_tools.runtime.forkserver``); each harness
imports the rest itself."""
TAIL_CHARS = 4000
PORT_TAKEN = "EADDRINUSE"  # torch's TCPStore: "... code: -98, name: EADDRINUSE, message: address already in use"


@dataclass(frozen=True)
class CompletedRank:
    """One rank's outcome: its exit code (negative: killed by that signal), its whole output, and why it stopped."""

    rank: int
    returncode: int
    log: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class RanksFailed(RuntimeError):
    """A spawn in which some rank failed or the timeout struck; the message carries the culprit's log tail."""

    def __init__(self, what: str, ranks: list[CompletedRank], culprit: int):
        self.ranks, self.culprit = ranks, culprit
        codes = [r.returncode for r in ranks]
        why = "timed out" if ranks[culprit].timed_out else f"rank {culprit} exited {codes[culprit]} first"
        if PORT_TAKEN in ranks[culprit].log:  # the spawner holds MASTER_PORT for rank 0's store
            why += ("; it bound MASTER_PORT itself, which the spawner holds for it: join with "
                    "hpc_tools.runtime.distenv.join_world")
        super().__init__(f"{what}: {why} (exit codes {codes}); rank {culprit} log tail:\n"
                         f"{ranks[culprit].log[-TAIL_CHARS:]}")


def spawn_ranks(argv: Sequence[str], world_size: int, *, env: Mapping[str, str] | None = None,
                cwd: str | Path | None = None, timeout_s: float = 600.0, log_dir: str | Path | None = None,
                check: bool = False, poll_s: float = 0.2) -> list[CompletedRank]:
    """Run ``argv`` on ``world_size`` local ranks to completion; one ``CompletedRank`` per rank, in rank order.

    ``env`` is added to every rank's environment (``rank_env``'s ``extra``); ``cwd`` defaults to the repository root.
    Logs go to ``log_dir/rank<R>.log`` when given (kept), else to a temporary folder. When one rank exits non-zero
    the others are stopped (SIGTERM, then SIGKILL); after ``timeout_s`` all are, and every result says ``timed_out``.
    ``check=True`` raises ``RanksFailed`` unless every rank exited 0.
    """
    with tempfile.TemporaryDirectory(prefix="spawn_ranks_") as tmp:
        logs = Path(log_dir or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        extra = {"PYTHONPATH": path, **(env or {})}
        ranks, culprit = _launch(argv, world_size, extra, cwd, timeout_s, logs, poll_s)
    if check and culprit is not None:
        raise RanksFailed(_describe(argv), ranks, culprit)
    return ranks


def _launch(argv: Sequence[str], world_size: int, extra: Mapping[str, str], cwd: str | Path | None,
            timeout_s: float, logs: Path, poll_s: float) -> tuple[list[CompletedRank], int | None]:
    """One start of every rank, to completion, failure or timeout: (results, first failed rank)."""
    files = [open(logs / f"rank{rank}.log", "wb") for rank in range(world_size)]
    procs: list = []
    args = list(map(str, argv))
    try:
        with listening_socket() as listener:  # held until rank 0's store serves on it
            port, fd = listener.getsockname()[1], listener.fileno()
            envs = [rank_env(rank, world_size, port, extra, store_fd=fd) for rank in range(world_size)]
            if forkserver.usable(args, uses_gpus=False):  # CPU ranks, as the local executor forks them
                procs = forkserver.start(args, envs, [log.fileno() for log in files], preload=SPAWN_PRELOAD,
                                         rank0_fds=(fd,), cwd=str(cwd or REPO))
            else:  # a session of its own per rank: stop_ranks signals the rank's whole process group
                procs = [subprocess.Popen(args, env=env, cwd=cwd or REPO, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, pass_fds=(fd,) if rank == 0 else ())
                         for rank, (env, log) in enumerate(zip(envs, files))]
        culprit, timed_out = _wait(procs, time.monotonic() + timeout_s, poll_s)
    finally:
        stop_ranks([p for p in procs if p.poll() is None])  # only on failure, timeout or interrupt
        end_groups(procs)  # what the ranks forked and left behind
        for log in files:
            log.close()
    return [CompletedRank(rank, p.returncode, (logs / f"rank{rank}.log").read_text(errors="replace"), timed_out)
            for rank, p in enumerate(procs)], culprit


def _describe(argv: Sequence[str]) -> str:
    """``python -m pkg.mod ...`` -> ``pkg.mod``; ``python path/script.py ...`` -> ``script.py``."""
    args = [str(a) for a in argv]
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    return Path(args[1]).name if len(args) > 1 else Path(args[0]).name


def _wait(procs: list[subprocess.Popen], deadline: float, poll_s: float) -> tuple[int | None, bool]:
    """Poll until all ranks exit, one fails, or the deadline; returns (the first failed rank or None, timed out)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return failed[0], False
        if all(code is not None for code in codes):
            return None, False
        if time.monotonic() > deadline:
            return 0, True
        time.sleep(poll_s)


def spawn_exit_code(argv: Sequence[str], world_size: int, *, env: Mapping[str, str] | None = None,
                    timeout_s: float = 600, log_tail: int = 6000) -> int:
    """``spawn_ranks(check=True)`` for a driver script's ``main``: 0, or the failing rank's exit code (124 when it
    timed out) after printing what failed and the tail of that rank's log to stderr."""
    import sys

    try:
        spawn_ranks(argv, world_size, env=env, timeout_s=timeout_s, check=True)
    except RanksFailed as failed:
        culprit = failed.ranks[failed.culprit]
        print(failed, file=sys.stderr)
        if log_tail:
            print(culprit.log[-log_tail:], file=sys.stderr)
        return 124 if culprit.timed_out else culprit.returncode
    return 0
