"""logs: print (or follow) a run's logs."""

from __future__ import annotations

import argparse
import glob
import sys
import time
from pathlib import Path

from hpc_tools.cli._common import add_runs_dir

NAME = "logs"
ORDER = 50
HELP = "print a run's log (rank 0 by default); -f follows it until the run ends"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help="run folder, run id (or prefix) or Slurm job id; default the latest")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the run ends")
    p.add_argument("--rank", type=int, default=0, help="which rank's log (default 0)")
    add_runs_dir(p)


def log_files(run, rank: int) -> list[Path]:
    """Log files of one rank, in the order they were written (Slurm runs: submitit's per-task files or the batch log)."""
    manifest = run.manifest()
    local = run.logs_dir / f"rank{rank:05d}.out"
    if local.is_file():
        return [local]
    pattern = manifest.get("log_glob")
    if pattern:
        return [Path(p) for p in sorted(glob.glob(pattern)) if f"_{rank}_log." in Path(p).name]
    if manifest.get("batch_log") and Path(manifest["batch_log"]).is_file():  # plain sbatch: one log for all ranks
        return [Path(manifest["batch_log"])]
    return sorted(run.logs_dir.glob("*.out"))


def run(args: argparse.Namespace) -> int:
    from hpc_tools.cli.status import refresh, resolve_run
    from hpc_tools.registry import TERMINAL_STATES

    r = resolve_run(args.run, args.runs_dir)
    offsets: dict[Path, int] = {}
    while True:
        for path in log_files(r, args.rank):
            with open(path, "rb") as f:
                f.seek(offsets.get(path, 0))
                chunk = f.read()
                offsets[path] = f.tell()
            sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        if not args.follow:
            return 0
        manifest = refresh(r)
        if manifest.get("state") in TERMINAL_STATES or manifest.get("slurm_state") in TERMINAL_STATES:
            for path in log_files(r, args.rank):  # drain what was written last
                with open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    sys.stdout.buffer.write(f.read())
            sys.stdout.flush()
            return 0
        time.sleep(1.0)
