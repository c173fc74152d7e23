"""cancel: stop a run (scancel on Slurm; SIGTERM to the rank processes of a local run) and its serving job (``serve``:
scancel, or its local process group; it returns once the server is gone)."""

from __future__ import annotations

import argparse
import os
import signal

from hpc_tools.cli._common import add_json, add_run_ref, add_runs_dir, emit_json, say
from hpc_tools.errors import UserError

NAME = "cancel"
ORDER = 60
HELP = "cancel a run (Slurm job or local processes) and the server `serve` started for it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_ref(p)
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.registry import now_iso, resolve_run
    from hpc_tools.runstate import end_state, refresh

    r = resolve_run(args.run, args.runs_dir)
    manifest = refresh(r)
    server = _stop_server(r)
    if server and (end_state(manifest) or manifest.get("kind") == "serve"):  # only the server was live
        if args.json:
            emit_json({"ok": True, "run_dir": str(r.path), "job_id": server.get("job_id"), "serve": server})
        else:
            job = f" (Slurm job {server['job_id']})" if server.get("job_id") else ""
            say(f"stopped the server of {r.run_id}{job}")
        return 0
    if manifest.get("kind") == "serve":
        raise UserError(f"the server of {r.run_id} already ended; nothing to cancel")
    if end_state(manifest):
        raise UserError(f"run {r.run_id} already ended ({end_state(manifest)}); nothing to cancel")
    if manifest.get("executor") in ("slurm", "sbatch"):
        from hpc_tools.executors.slurm import cancel
        from hpc_tools.slurm_client import REFUSED, SlurmError

        try:
            cancel(str(manifest["job_id"]))
        except SlurmError as exc:
            if exc.kind != REFUSED:
                raise
            raise UserError(f"{exc} (check the job with `squeue` / `sacct`)") from None
    else:
        pids = manifest.get("pids") or []
        if not pids:
            raise UserError(f"run {r.run_id} records no processes to stop")
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    r.update(event="cancel requested", cancel_requested=now_iso())
    if args.json:
        emit_json({"ok": True, "run_dir": str(r.path), "job_id": manifest.get("job_id")})
    else:
        job = f" (Slurm job {manifest['job_id']})" if manifest.get("job_id") else ""
        say(f"cancel requested for {r.run_id}{job}")
    return 0


def _stop_server(r) -> dict | None:
    """Stop the run's serving job when one is live (``hpc_tools.serving.job``); its record, else None."""
    from hpc_tools.serving.job import LIVE, refresh, stop

    record = refresh(r)
    if not record or record.get("state") not in LIVE:
        return None
    return stop(r)
