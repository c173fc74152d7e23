"""logs: print (or follow) a run's logs."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import BinaryIO

from hpc_tools.cli._common import add_runs_dir

NAME = "logs"
ORDER = 50
HELP = "print a run's log (rank 0 by default); -f follows it until the run ends"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help="run folder, run id (or prefix) or Slurm job id; default the latest")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the run ends")
    p.add_argument("--rank", type=int, default=0, help="which rank's log (default 0)")
    add_runs_dir(p)


def copy_new(run, rank: int, offsets: dict[Path, int], out: BinaryIO) -> None:
    """Write what the rank's log files gained since ``offsets`` (updated in place)."""
    from hpc_tools.runstate import log_files

    for path in log_files(run, rank):
        with open(path, "rb") as f:
            f.seek(offsets.get(path, 0))
            out.write(f.read())
            offsets[path] = f.tell()
    out.flush()


def follow(run, rank: int, out: BinaryIO, poll_s: float = 1.0) -> None:
    """Print the log as it grows until the run ends: the shared terminal test (``runstate.ended``) on the manifest
    refreshed from Slurm, so every terminal Slurm state (TIMEOUT, DEADLINE, BOOT_FAIL, ...) ends it."""
    from hpc_tools.runstate import ended, refresh

    offsets: dict[Path, int] = {}
    while True:
        copy_new(run, rank, offsets, out)
        if ended(refresh(run)):
            copy_new(run, rank, offsets, out)  # drain what was written last
            return
        time.sleep(poll_s)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.registry import resolve_run

    r = resolve_run(args.run, args.runs_dir)
    if args.follow:
        follow(r, args.rank, sys.stdout.buffer)
    else:
        copy_new(r, args.rank, {}, sys.stdout.buffer)
    return 0
