"""logs: print (or follow) a run's logs."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import BinaryIO

from hpc_tools.cli._common import add_run_ref, add_runs_dir, whole_number

NAME = "logs"
ORDER = 50
HELP = "print a run's log (rank 0's, or the whole batch log its ranks share); -f follows it until the run ends"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_ref(p, latest=True)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the run ends")
    p.add_argument("--rank", type=whole_number(0, what="a rank"), default=None,
                   help="only this rank's output: its own log file, or its labelled lines (`N: ...`) of a batch log "
                        "the ranks share (default: rank 0's file, or the whole batch log)")
    add_runs_dir(p)


def world_size(run) -> int | None:
    """The run's number of ranks: the manifest's, else nodes x gpus_per_node of its resolved recipe (one rank per
    GPU), read as plain YAML; None when neither says."""
    size = run.manifest().get("world_size")
    if isinstance(size, int):
        return size
    try:
        import yaml

        cluster = yaml.safe_load(run.recipe_path.read_text()).get("cluster") or {}
        return int(cluster["nodes"]) * int(cluster["gpus_per_node"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError):
        return None


def check_rank(run, rank: int | None) -> None:
    """A rank outside the run's world is a one-line UserError (not every log, nor silence)."""
    if rank is None:
        return
    size = world_size(run)
    if rank < 0 or (size is not None and rank >= size):
        from hpc_tools.errors import UserError

        valid = f"0..{size - 1}" if size else "0 or more"
        raise UserError(f"--rank {rank} is not a rank of run {run.run_id}, which has {size} rank(s) "
                        f"(give one of {valid})")


def label_filter(rank: int):
    """A function keeping only rank ``rank``'s lines of a batch log written with ``srun --label`` (``"N: "``, padded
    with spaces to the width of the largest rank), without the label."""
    pattern = re.compile(rb"^ *" + str(rank).encode() + rb": ")

    def keep(chunk: bytes) -> bytes:
        return b"".join(pattern.sub(b"", line, count=1) for line in chunk.splitlines(keepends=True)
                        if pattern.match(line))
    return keep


def copy_new(run, rank: int | None, offsets: dict[Path, int], out: BinaryIO, final: bool = True) -> None:
    """Write what the rank's log files gained since ``offsets`` (updated in place). A batch log the ranks share is
    cut to rank ``rank``'s labelled lines (whole lines only until ``final``: a line being written waits)."""
    from hpc_tools.runstate import log_files

    shared = run.manifest().get("batch_log")
    for path in log_files(run, 0 if rank is None else rank):
        keep = label_filter(rank) if rank is not None and shared and str(path) == shared else None
        with open(path, "rb") as f:
            f.seek(offsets.get(path, 0))
            data = f.read()
        if keep is not None:
            if not final and not data.endswith(b"\n"):
                data = data[:data.rfind(b"\n") + 1]
            out.write(keep(data))
        else:
            out.write(data)
        offsets[path] = offsets.get(path, 0) + len(data)
    out.flush()


def follow(run, rank: int | None, out: BinaryIO, poll_s: float = 1.0) -> None:
    """Print the log as it grows until the run ends: the shared terminal test (``runstate.ended``) on the manifest
    refreshed from Slurm, so every terminal Slurm state (TIMEOUT, DEADLINE, BOOT_FAIL, ...) ends it."""
    offsets: dict[Path, int] = {}
    while True:
        copy_new(run, rank, offsets, out, final=False)
        if over(run):
            copy_new(run, rank, offsets, out)  # drain what was written last
            return
        time.sleep(poll_s)


def over(run) -> bool:
    """Whether there is nothing more to follow: the run has ended (``runstate.ended``), or, for a served model folder
    (kind serve: no training of its own), its server is not live (it never started, or it stopped)."""
    from hpc_tools.runstate import ended, refresh

    manifest = refresh(run)
    if manifest.get("kind") == "serve":
        from hpc_tools.serving.job import LIVE
        from hpc_tools.serving.job import refresh as server

        return (server(run) or {}).get("state") not in LIVE
    return ended(manifest)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.registry import resolve_run

    r = resolve_run(args.run, args.runs_dir)
    check_rank(r, args.rank)
    if args.follow:
        follow(r, args.rank, sys.stdout.buffer)
    else:
        copy_new(r, args.rank, {}, sys.stdout.buffer)
    return 0
