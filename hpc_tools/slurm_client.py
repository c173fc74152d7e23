"""Whether the control plane uses this machine's Slurm client commands: they are on PATH and ``HPC_TOOLS_SLURM`` does
not turn them off.

``HPC_TOOLS_SLURM=off`` makes ``validate``, ``submit``, ``sweep``, ``resume`` and ``doctor`` treat the machine as one
without Slurm (no ``sinfo`` asked, ``submit`` runs locally), for a laptop or workstation that has Slurm's client
installed and no cluster to talk to; unset (or ``auto``), Slurm is used where its commands are on PATH. The ranks of
a job never read it: inside a Slurm job, Slurm's commands are what they are. The test suite sets it for every test
that does not ask for a Slurm cluster (tests/conftest.py), so the fast tier does not depend on this machine's Slurm.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from hpc_tools.errors import UserError

ENV = "HPC_TOOLS_SLURM"
VALUES = ("auto", "off")


def off_reason() -> str | None:
    """``HPC_TOOLS_SLURM=off`` when it turns Slurm off here, else None; a value other than off/auto is an error."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value == "off":
        return f"{ENV}=off"
    raise UserError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(VALUES)} (off: no Slurm on this machine; "
                    "auto, or unset: Slurm where its commands are on PATH)")


def absent_reason(name: str) -> str | None:
    """Why Slurm's client command ``name`` (``sbatch``, ``sinfo``) is not run here: ``HPC_TOOLS_SLURM=off`` or
    ``NAME is not on PATH``; None when it is on PATH and Slurm is not turned off."""
    return off_reason() or (None if shutil.which(name) else f"{name} is not on PATH")


def requeue(job_id: str, run=subprocess.run) -> str | None:
    """``scontrol requeue JOB_ID``: None when Slurm took it, else what Slurm said (``run``: the command runner)."""
    out = run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
    return None if out.returncode == 0 else (out.stderr or out.stdout or f"exit code {out.returncode}").strip()


def show_config(run=subprocess.run) -> dict[str, str]:
    """``scontrol show config`` as a mapping (``MaxArraySize`` -> ``"1001"``); raises UserError in one line when
    Slurm does not answer (``run``: the command runner)."""
    try:
        out = run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"scontrol show config did not answer ({exc}); check that Slurm's controller is up "
                        "(sinfo), or set HPC_TOOLS_SLURM=off") from None
    if out.returncode != 0:
        said = (out.stderr or out.stdout or f"exit code {out.returncode}").strip().splitlines()
        raise UserError(f"scontrol show config failed: {said[-1] if said else out.returncode}; check that Slurm's "
                        "controller is up (sinfo), or set HPC_TOOLS_SLURM=off")
    config = {}
    for line in out.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            config[key.strip()] = value.strip()
    return config
