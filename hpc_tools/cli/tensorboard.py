"""tensorboard: (re)build a run's or a sweep's TensorBoard event files from the step records and print the command that
shows them (or run it with --launch)."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import PORT, add_json, add_runs_dir, emit_json, say

NAME = "tensorboard"
ORDER = 62
HELP = "write a run's or sweep's TensorBoard files from its records and print the `tensorboard --logdir` command"
DESCRIPTION = """\
Write RUN/tensorboard/ anew from the run's step records (loss, val loss, lr, grad norm, tokens/s, TFLOP/s, MFU,
memory, step time), for every run of a sweep given a sweep folder, then print the command that opens TensorBoard on
them. A run still going keeps the event files its job writes as it runs. Every job already writes them unless
tracking.tensorboard is false; this command rebuilds them (after a resume, or for an older run)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ref", nargs="?", metavar="RUN_OR_SWEEP",
                   help="run folder, run id or prefix, Slurm job id, or sweep folder or id (default: the latest run)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write-only", action="store_true", help="write the event files; print no command")
    mode.add_argument("--launch", action="store_true",
                      help="then start TensorBoard on them (needs the tensorboard package)")
    p.add_argument("--port", type=PORT, default=6006, help="port for the printed or launched command (default 6006)")
    add_runs_dir(p)
    add_json(p)


def targets(ref: str | None, runs_dir: str | None):
    """(folder to point TensorBoard at, the run folders in it) for a run or sweep reference."""
    from pathlib import Path

    from hpc_tools.errors import UserError
    from hpc_tools.registry import RunFolder, resolve_run
    from hpc_tools.sweep.folder import SWEEP_FILE, SweepFolder
    from hpc_tools.tracking import TENSORBOARD_DIR

    if ref is None or not (Path(ref) / SWEEP_FILE).is_file():
        try:
            run = resolve_run(ref, runs_dir)
            return run.path / TENSORBOARD_DIR, [run]
        except UserError:
            if ref is None:
                raise
            try:
                sweep = SweepFolder.find(ref, runs_dir)
            except UserError:
                raise UserError(f"no run or sweep matches {ref!r} (see `python -m hpc_tools list`, or give a run "
                                "or sweep folder)") from None
    else:
        sweep = SweepFolder(ref)
    runs = []
    for cell in sweep.read().get("cells", []):
        folder = sweep.run_dir(cell)
        if folder is not None and RunFolder(folder).exists():
            runs.append(RunFolder(folder))
    if not runs:
        raise UserError(f"sweep {sweep.path} has no run folders yet (see `python -m hpc_tools sweep status`)")
    return sweep.path, runs


def refresh(run) -> dict:
    """Rebuild one run's event files unless its job is still writing them; what was done, as a row."""
    from hpc_tools.runstate import ended
    from hpc_tools.tracking import TENSORBOARD_DIR
    from hpc_tools.tracking.events import event_files
    from hpc_tools.tracking.rebuild import rebuild

    folder = run.path / TENSORBOARD_DIR
    if not ended(run.manifest()) and event_files(folder):
        return {"run_id": run.run_id, "events": str(folder), "steps": None, "rebuilt": False,
                "note": "running: its job writes these files as it goes"}
    folder, steps = rebuild(run.path)
    return {"run_id": run.run_id, "events": str(folder), "steps": steps, "rebuilt": True,
            "note": "" if steps else "no step records yet"}


def command(logdir, port: int) -> list[str]:
    return ["tensorboard", "--logdir", str(logdir), "--port", str(port)]


def run(args: argparse.Namespace) -> int:
    import os
    import shlex
    import sys

    from hpc_tools.errors import UserError
    from hpc_tools.tracking.events import tensorboard_installed

    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port} is not a TCP port (use 1-65535, e.g. 6006)")
    logdir, runs = targets(args.ref, args.runs_dir)
    rows = [refresh(r) for r in runs]
    cmd = command(logdir, args.port)
    if args.json:
        emit_json({"ok": True, "logdir": str(logdir), "runs": rows,
                   "command": None if args.write_only else shlex.join(cmd)})
    else:
        for row in rows:
            done = f"{row['steps']} steps" if row["rebuilt"] else "left as is"
            note = f" ({row['note']})" if row["note"] else ""
            print(f"{row['run_id']}: {done}{note} -> {row['events']}")
        if not args.write_only and not args.launch:
            print(f"view with: {shlex.join(cmd)}")
            if not tensorboard_installed():
                print("(the tensorboard package is not installed here: pip install tensorboard, or copy the folder "
                      "to a machine that has it)")
    if args.launch:
        if not tensorboard_installed():
            raise UserError("--launch needs the tensorboard package (pip install tensorboard); the files are written: "
                            f"run `{shlex.join(cmd)}` where it is installed")
        say(f"starting: {shlex.join(cmd)}")
        sys.stdout.flush()
        # tensorboard's own entry point, with this interpreter: its console script may not be on PATH
        os.execv(sys.executable, [sys.executable, "-m", "tensorboard.main", *cmd[1:]])
    return 0
