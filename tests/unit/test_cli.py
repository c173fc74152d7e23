"""The CLI as users run it: light commands, one-line errors with exit 2, nothing written on bad input."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest

from hpc_tools.errors import UserError
from tests.helpers import REPO, run_cli

LIGHT = [["--help"], ["validate", "recipes/gpt_3d.yaml", "--no-fit"], ["render", "recipes/gpt_3d.yaml", "-o", "-"],
         ["submit", "--help"], ["validate", "--explain", "parallel.tensor_size"], ["validate", "--rules"]]


@pytest.mark.parametrize("args", LIGHT, ids=lambda a: " ".join(a[:2]))
def test_control_plane_commands_do_not_import_torch(args):
    code = ("import sys, runpy; sys.argv = ['hpc_tools', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('hpc_tools', run_name='__main__')\nexcept SystemExit: pass\n"
            "heavy = sorted(m for m in ('torch', 'megatron', 'deepspeed', 'transformers', 'pandas')\n"
            "               if m in sys.modules)\n"
            "print('HEAVY=' + ','.join(heavy))")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "HEAVY=\n" in out.stdout or out.stdout.endswith("HEAVY="), out.stdout[-300:]


def test_validate_reports_every_violation_with_exit_2():
    # The values the messages quote are set here, so the test does not depend on the numbers in recipes/.
    out = run_cli("validate", "recipes/gpt_3d.yaml", "--set", "model.num_attention_heads=16", "--set",
                  "parallel.tensor_size=3", "--set", "training.lr=0.0002", "--set", "training.min_lr=1")
    assert out.returncode == 2
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert not [ln for ln in out.stdout.splitlines() if ln.startswith("error:")]  # errors: stderr, every command
    # tensor_size=3 breaks two rules (the world size, the heads): one line, whose fix is what both admit
    needle = ("parallel.tensor_size=3 x parallel.pipeline_size=2 must divide the world size cluster.nodes x "
              "cluster.gpus_per_node = 16 and must divide model.num_attention_heads=16 (try 1, 2, 4, 8)")
    assert any(needle in e for e in errors), errors
    assert sum("parallel.tensor_size=3" in e for e in errors) == len({e.split(":")[1] for e in errors}), errors
    assert any("training.min_lr=1.0 exceeds training.lr=0.0002" in e for e in errors)
    assert "Traceback" not in out.stderr + out.stdout


def test_validate_json():
    out = run_cli("validate", "recipes/gpt_zero.yaml", "--set", "backend.deepspeed.zero_stage=7", "--json")
    data = json.loads(out.stdout)
    assert out.returncode == 2 and data["ok"] is False
    err = data["results"][0]["errors"][0]
    assert err["path"] == "backend.deepspeed.zero_stage" and err["value"] == "7" and "0, 1, 2 or 3" in err["fix"]


def test_validate_lists_rules():
    out = run_cli("validate", "--rules")
    assert out.returncode == 0 and "layout_fills_world:" in out.stdout


@pytest.mark.parametrize("args,needle", [
    (["submit", "recipes/nope.yaml"], "recipe recipes/nope.yaml does not exist"),
    (["submit", "recipes/gpt_3d.yaml", "--set", "parallel.tensorr=2", "--executor", "local"],
     "did you mean 'tensor_size'"),
    (["submit", "recipes/gpt_3d.yaml", "--set", "nonsense", "--executor", "local"], "must look like section.key=value"),
    (["render", "recipes/gpt_3d.yaml", "--set", "cluster.time_limit=soon"],
     "cluster.time_limit=soon is not in Slurm's --time format"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, needle):
    jobs_before = {p.name: p.read_text() for p in (REPO / "jobs").glob("*.sbatch")}
    out = run_cli(*args, "--runs-dir" if args[0] == "submit" else "--jobs-dir", str(tmp_path / "out"))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("error: ")
    assert not (tmp_path / "out").exists()
    assert {p.name: p.read_text() for p in (REPO / "jobs").glob("*.sbatch")} == jobs_before


def test_render_all_check_detects_drift(tmp_path):
    jobs = tmp_path / "jobs"
    shutil.copytree(REPO / "jobs", jobs)
    assert run_cli("render", "--all", "--check", "--jobs-dir", str(jobs)).returncode == 0
    target = jobs / "gpt_3d.sbatch"
    nodes = re.search(r"^#SBATCH --nodes=(\d+)$", target.read_text(), re.M).group(1)
    target.write_text(target.read_text().replace(f"--nodes={nodes}", f"--nodes={int(nodes) + 1}"))
    out = run_cli("render", "--all", "--check", "--jobs-dir", str(jobs))
    assert out.returncode == 1 and "python -m hpc_tools render --all" in out.stderr
    assert f"-#SBATCH --nodes={int(nodes) + 1}" in out.stdout
    assert run_cli("render", "--all", "--jobs-dir", str(jobs)).returncode == 0
    assert target.read_text() == (REPO / "jobs/gpt_3d.sbatch").read_text()


def test_status_without_runs_says_how_to_start(tmp_path):
    out = run_cli("status", "--runs-dir", str(tmp_path))
    assert out.returncode == 2 and "submit one with" in out.stderr


def fake_slurm(tmp_path, scontrol_body: str):
    """A PATH holding Slurm's client commands as stand-ins (`sbatch` present, `scontrol` answering as told) and this
    Python; nothing else from the machine's PATH, so the real cluster is never asked."""
    import os
    import stat

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    for name, body in (("sbatch", 'echo "sbatch must not be called" >&2; exit 1'), ("scontrol", scontrol_body)):
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.path.dirname(shutil.which('bash'))}", "PYTHONPATH": str(REPO)}


@pytest.mark.slurm_client
@pytest.mark.parametrize("scontrol", [
    'echo "Slurmctld(primary) at ctl is DOWN"; exit 1',  # a controller restart
    "exit 1",  # no answer at all
])
@pytest.mark.parametrize("executor", ["auto", "slurm"])
def test_slurm_installed_but_not_answering_is_an_error_never_a_local_run(tmp_path, scontrol, executor):
    env = fake_slurm(tmp_path, scontrol)
    out = run_cli("submit", "recipes/comm_check.yaml", "--executor", executor, "--runs-dir", str(tmp_path / "runs"),
                  env=env, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("error: Slurm is installed but its controller does not answer")
    assert "--executor local" in lines[0] and "retry" in lines[0]
    assert not (tmp_path / "runs").exists(), "a run folder was made"


@pytest.mark.slurm_client
def test_no_slurm_installed_means_local_said_in_one_line(tmp_path, monkeypatch):
    from hpc_tools.submission import choose_executor

    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    executor, note = choose_executor("auto")
    assert executor == "local" and note.startswith("no Slurm here (sbatch is not on PATH)") and "\n" not in note
    assert choose_executor("local") == ("local", "")
    with pytest.raises(UserError, match="--executor local"):
        choose_executor("slurm")


@pytest.mark.slurm_client
def test_slurm_answering_means_slurm(tmp_path, monkeypatch):
    from hpc_tools.submission import choose_executor

    env = fake_slurm(tmp_path, 'echo "Slurmctld(primary) at ctl is UP"')
    monkeypatch.setenv("PATH", env["PATH"])
    assert choose_executor("auto") == ("slurm", "")


# One bad input per command (a missing recipe, run or file): the error is on stderr, stdout stays empty.
BAD_INPUT = {
    "validate": ["validate", "nope.yaml"], "plan": ["plan", "nope.yaml"], "render": ["render", "nope.yaml"],
    "submit": ["submit", "nope.yaml"], "sweep": ["sweep", "nope.yaml"], "doctor": ["doctor", "nope.yaml"],
    "status": ["status", "no-such-run"], "logs": ["logs", "no-such-run"], "cancel": ["cancel", "no-such-run"],
    "resume": ["resume", "no-such-run"], "analyze": ["analyze", "no-such-run"],
    "report": ["report", "no-such-run", "--out", "{tmp}/report"], "export": ["export", "no-such-run", "--out",
                                                                                "{tmp}/model"],
    "tensorboard": ["tensorboard", "no-such-run"], "list": ["list", "--limit", "many"],
    "data": ["data", "prepare", "{tmp}/nope.txt", "--out", "{tmp}/prepared"],
    "preflight": ["preflight", "nope.yaml"],
    "eval": ["eval", "no-such-run", "--tasks", "arc_easy"],
    "quantize": ["quantize", "no-such-run", "--scheme", "int8", "--out", "{tmp}/quantized"],
    "serve": ["serve", "no-such-run", "--http-port", "0", "--grpc-port", "0"],
    "generate": ["generate", "no-such-run", "--prompt", "x"],
}


def test_every_command_puts_its_errors_on_stderr(capsys, tmp_path, monkeypatch):
    from hpc_tools.cli import command_specs, main

    monkeypatch.setenv("HPC_TOOLS_RUNS_DIR", str(tmp_path / "runs"))
    assert {s.name for s in command_specs()} <= set(BAD_INPUT), "add the new command's bad input here"
    for name, argv in BAD_INPUT.items():
        capsys.readouterr()
        try:
            code = main([a.format(tmp=tmp_path) for a in argv])
        except SystemExit as exc:  # argparse's own refusal (list takes no path): usage and error, on stderr
            code = exc.code
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert code == 2 and not out.out.strip(), (name, out.out[:300])
        assert lines and "error: " in lines[-1] and (len(lines) == 1 or lines[0].startswith("usage:")), (name, lines)
    # a recipe that breaks rules, and a plan whose fit check fails: the report on stdout, each error on stderr
    code = main(["validate", "recipes/gpt_3d.yaml", "--offline", "--set", "parallel.tensor_size=3"])
    out = capsys.readouterr()
    assert code == 2 and "error:" not in out.out and "parallel.tensor_size=3" in out.err
    code = main(["plan", "recipes/gpt_3d.yaml", "--set", "cluster.gpu_mem_gb=1"])
    out = capsys.readouterr()
    assert code == 1 and "error:" not in out.out and out.out.strip()
    assert [ln for ln in out.err.splitlines() if ln.startswith("error: ")], out.err
