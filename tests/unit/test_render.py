"""Rendered sbatch scripts: golden files in jobs/, and hostile strings that must never execute."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpc_tools.recipe.load import load_recipe, resolve
from hpc_tools.render.envsetup import launch_prefix, setup_lines, srun_args
from hpc_tools.render.sbatch import job_script_path, render_sbatch
from tests.helpers import RECIPES, REPO, srun_on_path


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_committed_job_scripts_match_their_recipes(path):
    rel = path.relative_to(REPO)
    expected = render_sbatch(load_recipe(path), rel.as_posix())
    script = REPO / job_script_path(rel)
    assert script.is_file(), f"{script} is missing; regenerate with: python -m hpc_tools render --all"
    assert script.read_text() == expected, (
        f"{script.relative_to(REPO)} drifted from {rel}; regenerate with: python -m hpc_tools render --all")


def test_script_shape():
    recipe = load_recipe(REPO / "recipes/gpt_3d.yaml")
    c = recipe.cluster
    text = render_sbatch(recipe, "recipes/gpt_3d.yaml")
    assert text.startswith("#!/bin/bash\n")
    sbatch = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert f"#SBATCH --nodes={c.nodes}" in sbatch and f"#SBATCH --ntasks-per-node={c.gpus_per_node}" in sbatch
    assert f"#SBATCH --gpus-per-node={c.gpus_per_node}" in sbatch
    assert f"#SBATCH --signal=USR2@{c.signal_delay_s}" in sbatch
    assert "#SBATCH --requeue" in sbatch and "#SBATCH --output=%x-%j.out" in sbatch
    # srun does not inherit --cpus-per-task from sbatch (Slurm 22.05); --label tags each line with its rank
    assert (f"srun --kill-on-bad-exit=1 --cpus-per-task={c.cpus_per_task} --mem=0 --label python3 -m "
            "hpc_tools.runtime.rank") in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def hostile(mark: Path) -> list[str]:
    """Shell payloads a single-line field may hold (newlines and control characters are refused by the schema:
    tests/unit/test_hostile_inputs.py); each must arrive literally, never run."""
    m = str(mark)
    return [f"$(touch {m})", f"`touch {m}`", f"'; touch {m}; echo '", f'"; touch {m}; echo "', f"x|touch {m}",
            f"; touch {m}", f"${{IFS}}touch${{IFS}}{m}", f"a' && touch {m} #"]


def hostile_recipe(mark: Path, python: str) -> dict:
    bad = hostile(mark)
    return {
        "name": "hostile",
        "description": bad[0] + f"\ntouch {mark}\n" + bad[4],  # free text: newlines allowed, never a script line
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 512},
        "data": {"source": "files", "paths": bad, "text_field": bad[2], "tokenizer": bad[1]},
        "checkpoint": {"dir": bad[3], "load_path": bad[5]},
        "backend": {"kind": "deepspeed", "deepspeed": {"nvme_path": bad[6], "pretrained_path": bad[7],
                                                       "config_overrides": {"k": bad[0]}}},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu", "python": python,
                    "setup": {"modules": bad, "conda_env": bad[1],
                              "env": {f"V{i}": b for i, b in enumerate(bad)},
                              "container": {"kind": "apptainer", "image": bad[0], "mounts": bad[2:4]}}},
    }


def test_shell_lines_quote_every_value(tmp_path):
    recipe = resolve(hostile_recipe(tmp_path / "pwned", sys.executable))
    c = recipe.cluster
    bad = hostile(tmp_path / "pwned")
    lines = setup_lines(c)
    assert [shlex.split(ln)[-1] for ln in lines if ln.startswith("module load")] == bad
    exports = [shlex.split(ln)[1].split("=", 1) for ln in lines if ln.startswith("export")]
    assert exports[0] == ["OMP_NUM_THREADS", str(c.cpus_per_task)]
    assert [value for _, value in exports[1:]] == bad
    venv = resolve({**hostile_recipe(tmp_path / "pwned", "python3"),
                    "cluster": {"gpu_type": "cpu", "setup": {"venv": bad[2]}}}).cluster
    assert shlex.split(setup_lines(venv)[0]) == ["source", bad[2] + "/bin/activate"]
    assert launch_prefix(c) == ["apptainer", "exec", "--bind", bad[2], "--bind", bad[3], bad[0]]
    pyxis = c.model_copy(update={"setup": c.setup.model_copy(update={"container": c.setup.container.model_copy(
        update={"kind": "pyxis"})})})
    assert srun_args(pyxis)[0] == f"--container-image={bad[0]}"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_hostile_strings_never_execute(tmp_path):
    """Run the rendered script (stand-ins for the Slurm/cluster commands record their arguments; the open_run step
    runs for real) and check that no payload ran and every value arrived literally."""
    mark = tmp_path / "pwned"
    raw = hostile_recipe(mark, sys.executable)
    script = render_sbatch(resolve(raw), "hostile.yaml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    log = shlex.quote(str(calls))
    record = f'printf "%s\\0" "$(basename "$0")" "$@" >> {log}; printf "\\n" >> {log}'
    _stub(bin_dir, "srun", record)
    _stub(bin_dir, "module", record)
    _stub(bin_dir, "conda", record)
    _stub(bin_dir, "apptainer", record)  # the set-up checks it is there; srun (a stub) never starts it
    _stub(bin_dir, "scontrol", 'echo node1')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node1", "SLURM_SUBMIT_DIR": str(tmp_path),
           "HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs"),
           "PYTHONPATH": str(REPO)}
    (tmp_path / "job.sbatch").write_text(script)
    # `module` is a shell function on clusters; here the stub on PATH plays it.
    out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert not mark.exists(), "a hostile string was executed"
    recorded = [line.split("\0") for line in calls.read_text().split("\0\n") if line]
    bad = hostile(mark)
    assert [c[-1] for c in recorded if c[0] == "module"] == bad
    (srun_call,) = [c for c in recorded if c[0] == "srun"]
    assert srun_call[1:12] == ["--kill-on-bad-exit=1", "--cpus-per-task=8", "--mem=0", "--label", "apptainer", "exec",
                               "--bind", bad[2], "--bind", bad[3], bad[0]]
    run_dir = tmp_path / "runs" / "hostile-j4242"
    assert srun_call[-2:] == ["--run-dir", str(run_dir)]
    saved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert saved["description"] == raw["description"] and saved["data"]["paths"] == bad
    assert saved["cluster"]["setup"]["env"] == raw["cluster"]["setup"]["env"]


def test_script_takes_the_rendezvous_from_distenv(tmp_path):
    """The batch script and a submitit rank (no script) agree on the rendezvous: hpc_tools.runtime.distenv owns it."""
    from hpc_tools.runtime.distenv import DistEnv, port_for_job

    recipe = resolve({"name": "rdzv", "backend": {"kind": "comm_check"},
                      "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                "vocab_size": 512},
                      "cluster": {"nodes": 2, "gpus_per_node": 1, "gpu_type": "cpu", "python": sys.executable}})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "seen"
    _stub(bin_dir, "srun", f'echo "$MASTER_ADDR $MASTER_PORT" > {shlex.quote(str(seen))}')
    _stub(bin_dir, "scontrol", 'echo node7; echo node8')
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[7-8]"}
    env = {**os.environ, **slurm, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path),
           "HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(REPO), "MASTER_ADDR": "stale-from-login",
           "MASTER_PORT": "1"}
    (tmp_path / "job.sbatch").write_text(render_sbatch(recipe, "rdzv.yaml"))
    out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert seen.read_text().split() == ["node7", str(port_for_job(4242))]
    rank = DistEnv.from_environ({**slurm, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "PATH": env["PATH"]})
    assert (rank.master_addr, rank.master_port) == ("node7", port_for_job(4242))


# --- a newline in a recipe path; failing set-up lines (both launch paths) -----------------------------------------

def stub_env(tmp_path: Path, failing: str = "") -> tuple[dict, Path]:
    """PATH stand-ins for the cluster commands (each records its arguments; `module load <failing>` fails as a
    missing module does), and the environment of a Slurm batch step."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    record = f'printf "%s\\0" "$(basename "$0")" "$@" >> {shlex.quote(str(calls))}; printf "\\n" >> ' \
             f'{shlex.quote(str(calls))}'
    _stub(bin_dir, "srun", record)
    _stub(bin_dir, "module", record + (f'\n[ "$2" = {shlex.quote(failing)} ] && '
                                       f'{{ echo "Lmod has detected the following error: $2 is unknown" >&2; exit 1; }}'
                                       "\nexit 0" if failing else ""))
    _stub(bin_dir, "scontrol", 'echo node1')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node1", "SLURM_SUBMIT_DIR": str(tmp_path), "PYTHONPATH": str(REPO),
           "HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs")}
    env.pop("HPC_TOOLS_RUN_DIR", None)
    return env, calls


def recorded(calls: Path) -> list[list[str]]:
    return [line.split("\0") for line in calls.read_text().split("\0\n") if line] if calls.exists() else []


def small_recipe(**cluster) -> dict:
    return {"name": "setup", "backend": {"kind": "comm_check"},
            "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                      "vocab_size": 512},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu", "python": sys.executable, **cluster}}


def test_a_newline_in_the_recipe_file_name_stays_in_its_comment(tmp_path):
    """The original hijack: `render` of a recipe whose file name holds a newline and a command."""
    mark = tmp_path / "pwned"  # the script runs in tmp_path
    recipe_file = tmp_path / "x\ntouch pwned\n.yaml"
    recipe_file.write_text(yaml.safe_dump(small_recipe()))
    script = tmp_path / "job.sbatch"
    out = subprocess.run([sys.executable, "-m", "hpc_tools", "render", str(recipe_file), "-o", str(script)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    header = script.read_text().splitlines()[1]
    assert header.startswith("# setup: generated by hpc_tools from ") and "\\ntouch " in header
    env, calls = stub_env(tmp_path)
    run = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert not mark.exists(), "a command in the recipe's file name ran"
    assert [c[0] for c in recorded(calls)] == ["srun"]


SETUPS = {"module": ({"setup": {"modules": ["good", "nonexistent"]}}, "module load nonexistent"),
          "conda": ({"setup": {"conda_env": "missing-env"}}, 'HPC_TOOLS_CONDA_HOOK="$(conda shell.bash hook)"'),
          "venv": ({"setup": {"venv": "/nonexistent/venv"}}, "source /nonexistent/venv/bin/activate")}


def submitit_script(recipe, run_dir: Path) -> str:
    """The batch script submitit would submit for this run (its own renderer, nothing submitted)."""
    from hpc_tools.executors.slurm import make_executor

    with srun_on_path():
        executor = make_executor(recipe, run_dir / "submitit", run_dir=run_dir)
    return executor._make_submission_file_text(executor._submitit_command_str, "uid")


@pytest.mark.parametrize("path", ["sbatch", "submitit"])
@pytest.mark.parametrize("kind", SETUPS)
def test_a_failing_setup_line_fails_the_job_naming_the_line(tmp_path, path, kind):
    """Both launch paths stop at the failing line, before any rank starts, and say which line in the batch log and
    in the manifest (a plain sbatch job's run folder is made from the recipe its script carries)."""
    from hpc_tools.registry import RunFolder
    from hpc_tools.submission import new_run

    cluster, line = SETUPS[kind]
    recipe = resolve(small_recipe(**cluster))
    env, calls = stub_env(tmp_path, failing="nonexistent")
    if path == "sbatch":
        script, run_dir = render_sbatch(recipe, "setup.yaml"), tmp_path / "runs" / "setup-j4242"
    else:
        run_dir = new_run(recipe, tmp_path / "runs", "slurm", "setup.yaml").path
        script = submitit_script(recipe, run_dir)
    (tmp_path / "job.sbatch").write_text(script)
    out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    told = [ln for ln in out.stderr.splitlines() if ln.startswith("hpc_tools: environment set-up failed")]
    assert len(told) == 1 and told[0].endswith(f": {line}"), out.stderr
    assert "srun" not in [c[0] for c in recorded(calls)], "ranks started after a failed set-up line"
    manifest = RunFolder(run_dir).manifest()
    assert manifest["state"] == "FAILED" and manifest["setup_failed"] == line and line in manifest["error"]
    assert manifest["events"][-1]["event"] == "setup failed"


def test_submitit_script_runs_hostile_values_literally(tmp_path):
    """The submitit path: its batch script, with every string the schema lets through made hostile, runs no payload
    (stand-ins for srun/module/conda/apptainer record their arguments)."""
    from hpc_tools.submission import new_run

    mark = tmp_path / "pwned"
    recipe = resolve(hostile_recipe(mark, sys.executable))
    run_dir = new_run(recipe, tmp_path / "runs", "slurm", "hostile.yaml").path
    (tmp_path / "job.sbatch").write_text(submitit_script(recipe, run_dir))
    env, calls = stub_env(tmp_path)
    for name in ("conda", "apptainer"):
        _stub(tmp_path / "bin", name, f'printf "%s\\0" "$(basename "$0")" "$@" >> {shlex.quote(str(calls))}; '
                                      f'printf "\\n" >> {shlex.quote(str(calls))}')
    out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not mark.exists(), "a hostile string was executed"
    calls_made = recorded(calls)
    assert [c[-1] for c in calls_made if c[0] == "module"] == hostile(mark)
    (srun_call,) = [c for c in calls_made if c[0] == "srun"]
    assert hostile(mark)[0] in srun_call  # the apptainer image, one literal word
