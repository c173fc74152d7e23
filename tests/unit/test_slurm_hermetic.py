"""This machine's Slurm, whichever state it is in, and ``HPC_TOOLS_SLURM`` (hpc_tools/slurm_client.py): a Slurm
client with no controller is one note on stderr, never an error line; ``HPC_TOOLS_SLURM=off`` is "no Slurm here"
with a client on PATH; and the fast tier runs with it off unless a test asks for Slurm (tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import stat
import sys

import pytest

from hpc_tools.errors import UserError
from tests.helpers import REPO, run_cli

NO_CONTROLLER = ('echo "{name}: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host" >&2; '
                 'echo "{name}: fatal: Could not establish a configuration source" >&2; exit 1')  # Slurm 22.05's


def client_without_controller(tmp_path) -> dict[str, str]:
    """A PATH whose Slurm commands answer as Slurm's client does on a machine without a cluster (each call recorded
    in ``calls``), and this Python; nothing else of the machine's PATH, so its own Slurm is never asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    for name in ("sinfo", "sbatch", "scontrol", "squeue", "sacct", "scancel", "srun"):
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\necho {name} >> {tmp_path / 'calls'}\n{NO_CONTROLLER.format(name=name)}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.path.dirname(shutil.which('bash'))}", "PYTHONPATH": str(REPO)}


def calls(tmp_path) -> list[str]:
    f = tmp_path / "calls"
    return f.read_text().split() if f.exists() else []


def test_a_test_that_asks_for_no_slurm_runs_with_slurm_off():
    assert os.environ.get("HPC_TOOLS_SLURM") == "off"


@pytest.mark.slurm_client
def test_a_test_with_its_own_slurm_stand_ins_runs_with_it_unset():
    assert "HPC_TOOLS_SLURM" not in os.environ


@pytest.mark.slurm_client
def test_a_client_without_controller_is_one_note_on_stderr(tmp_path):
    out = run_cli("validate", "recipes/comm_check.yaml", env=client_without_controller(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ok: recipes/comm_check.yaml", "ok: recipes/comm_check.yaml (profile local)"]
    [note] = out.stderr.splitlines()
    assert note.startswith("note: not checked against Slurm: Slurm unreachable (sinfo: fatal: Could not establish a "
                           "configuration source)"), note
    assert "HPC_TOOLS_SLURM=off" in note and "--offline" in note
    assert calls(tmp_path) == ["sinfo"]  # asked once per process


@pytest.mark.slurm_client
def test_slurm_off_asks_no_slurm_command_and_says_nothing(tmp_path):
    env = {**client_without_controller(tmp_path), "HPC_TOOLS_SLURM": "off"}
    out = run_cli("validate", "recipes/comm_check.yaml", env=env)
    assert (out.returncode, out.stderr) == (0, "")
    verbose = run_cli("validate", "recipes/comm_check.yaml", "--verbose", env=env)
    assert verbose.stderr.splitlines() == ["note: not checked against Slurm: no Slurm here (HPC_TOOLS_SLURM=off)"]
    doctor = run_cli("doctor", "--json", env=env)
    import json

    [row] = [r for r in json.loads(doctor.stdout)["checks"] if r["name"] == "slurm"]
    assert row["status"] == "skip" and "HPC_TOOLS_SLURM=off" in row["detail"], row
    assert calls(tmp_path) == []


@pytest.mark.slurm_client
def test_slurm_off_submits_locally_and_refuses_executor_slurm(tmp_path, monkeypatch):
    from hpc_tools.submission import choose_executor

    monkeypatch.setenv("PATH", client_without_controller(tmp_path)["PATH"])
    monkeypatch.setenv("HPC_TOOLS_SLURM", "off")
    executor, note = choose_executor("auto")
    assert executor == "local" and note.startswith("no Slurm here (HPC_TOOLS_SLURM=off): running locally"), note
    with pytest.raises(UserError, match=r"HPC_TOOLS_SLURM=off turns off here \(unset it, or use --executor local\)"):
        choose_executor("slurm")
    monkeypatch.setenv("HPC_TOOLS_SLURM", "auto")  # the default: the client is there, its controller is not
    with pytest.raises(UserError, match="controller does not answer.*HPC_TOOLS_SLURM=off"):
        choose_executor("auto")
    assert calls(tmp_path) == ["scontrol"]


@pytest.mark.slurm_client
def test_an_unknown_slurm_setting_is_one_line(tmp_path):
    env = {**client_without_controller(tmp_path), "HPC_TOOLS_SLURM": "maybe"}
    out = run_cli("validate", "recipes/comm_check.yaml", env=env)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: HPC_TOOLS_SLURM='maybe' is not one of auto, off (off: no Slurm on this machine; auto, or unset: Slurm "
        "where its commands are on PATH)"], out.stderr
