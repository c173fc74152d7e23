"""Scripts that fit real clusters: `set -u` never around module/conda (a real Lmod-style `module` shell function that
reads unset variables), pyxis workdir and mounts with every hpc_tools step inside the container, group-readable run
folders, the git tree's state in the manifest, dry runs without a controller, and `logs --rank`."""

from __future__ import annotations

import io
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_tools.cli.logs import copy_new, label_filter
from hpc_tools.recipe.load import resolve
from hpc_tools.registry import atomic_write, git_tree
from hpc_tools.render.sbatch import render_sbatch
from hpc_tools.submission import new_run
from tests.helpers import REPO, run_cli
from tests.unit.test_render import recorded, small_recipe, stub_env, submitit_script

COMM = "recipes/comm_check.yaml"
# Lmod's `module` is a shell function exported to batch jobs (BASH_FUNC_module%%); like Lmod's own, this one reads
# variables that are normally unset, so it dies under `set -u` ("unbound variable").
LMOD_LIKE = '() {  local dbg="$LMOD_SH_DBG_ON$__LMOD_REF_COUNT_MODULEPATH"; printf "%s\\n" "$*" >> "$MODULE_CALLS"; }'


def test_module_function_that_reads_unset_variables_runs_before_set_u(tmp_path):
    recipe = resolve(small_recipe(setup={"modules": ["cuda/12.4", "nccl"]}))
    script = render_sbatch(recipe, "setup.yaml")
    lines = script.splitlines()
    assert lines.index("set -euo pipefail") > max(i for i, ln in enumerate(lines) if ln.startswith("module load"))
    assert not [ln for ln in lines[:lines.index("set -euo pipefail")] if ln.lstrip().startswith("set -")]
    env, calls = stub_env(tmp_path)
    (tmp_path / "bin" / "module").unlink()  # the shell function plays it, as on a cluster
    env.update({"BASH_FUNC_module%%": LMOD_LIKE, "MODULE_CALLS": str(tmp_path / "module-calls")})
    for name in ("LMOD_SH_DBG_ON", "__LMOD_REF_COUNT_MODULEPATH"):
        env.pop(name, None)
    # the control: under `set -u` this function ends the shell
    control = subprocess.run(["bash", "-c", "set -u; module load x; echo survived"], env=env, capture_output=True,
                             text=True, timeout=30)
    assert control.returncode != 0 and "unbound variable" in control.stderr and "survived" not in control.stdout
    (tmp_path / "job.sbatch").write_text(script)
    out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "module-calls").read_text().splitlines() == ["load cuda/12.4", "load nccl"]
    assert [c[0] for c in recorded(calls)] == ["srun"]  # the ranks started after the set-up


def test_pyxis_runs_every_step_in_one_named_container_with_workdir_and_mounts(tmp_path):
    """Every hpc_tools step inside one named container (issue 25 item 10: imported once per node, not once per step);
    the rank step, which spans every node, mounts nothing that exists on the batch host only (item 3: Slurm spools
    the script there, and pyxis refuses a missing mount source); the steps that read the script run on the batch host
    and mount it; the container is removed from every node at the end."""
    mark = tmp_path / "pwned"
    image = f"$(touch {mark})"
    recipe = resolve(small_recipe(cpus_per_task=3, setup={"container": {"kind": "pyxis", "image": image,
                                                                        "mounts": ["/scratch:/scratch", "a b:/c"]}}))
    env, calls = stub_env(tmp_path)
    env.update(HPC_TOOLS_REPO=str(REPO), SLURMD_NODENAME="node1", SLURM_JOB_NUM_NODES="2")
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(recipe, "pyxis.yaml"))
    out = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not mark.exists(), "the image name ran as code"
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / "setup-j4242"
    mounts = f"{REPO}:{REPO},{runs}:{runs},/scratch:/scratch,a b:/c"
    name = "--container-name=hpc_tools_4242"
    container = [f"--container-image={image}", name, f"--container-mounts={mounts}", f"--container-workdir={REPO}"]
    on_batch_host = [f"--container-image={image}", name, f"--container-mounts={mounts},{script}:{script}:ro",
                     f"--container-workdir={REPO}"]
    steps = recorded(calls)
    one_task = ["srun", "--nodes=1", "--ntasks=1", "--nodelist=node1", *on_batch_host, sys.executable, "-m"]
    ranks = ["srun", "--kill-on-bad-exit=1", "--cpus-per-task=3", "--mem=0", "--label", *container, sys.executable,
             "-m", "hpc_tools.runtime.rank"]
    assert len(steps) == 5 and steps[2][:len(ranks)] == ranks
    assert not any(str(script) in word for word in steps[2]), "the rank step must not mount the spooled script"
    assert [steps[i][:len(one_task) + 1] for i in (0, 1, 3)] == [
        one_task + [f"hpc_tools.{m}"] for m in ("job.open_run", "runtime.distenv", "job.epilogue")]
    assert steps[2][-2:] == ["--run-dir", str(run_dir)]
    assert steps[4] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "enroot", "remove", "--force",
                        "pyxis_hpc_tools_4242"]
    assert runs.is_dir()  # made before pyxis mounts it


def test_submitit_path_gets_cpus_and_pyxis_mounts(tmp_path):
    recipe = resolve(small_recipe(cpus_per_task=3, setup={"container": {"kind": "pyxis", "image": "nvcr.io#img"}}))
    run_dir = new_run(recipe, tmp_path / "runs", "slurm", "pyxis.yaml").path
    srun = [ln for ln in submitit_script(recipe, run_dir).splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1
    words = shlex.split(srun[0])
    assert "--cpus-per-task=3" in words and "--mem=0" in words
    assert f"--container-mounts={REPO}:{REPO},{run_dir}:{run_dir}" in words
    assert f"--container-workdir={REPO}" in words


def _modes(path: Path) -> tuple[int, ...]:
    return tuple(stat.S_IMODE((path / name).stat().st_mode) for name in ("", "logs", "manifest.json", "recipe.yaml",
                                                                         "job.sbatch"))


@pytest.mark.parametrize("mode, umask, expected", [
    ("0755", 0o022, (0o755, 0o755, 0o644, 0o644, 0o644)),  # the default: a teammate can read the run
    ("0750", 0o022, (0o750, 0o750, 0o640, 0o640, 0o640)),  # the group only
    ("0755", 0o077, (0o700, 0o700, 0o600, 0o600, 0o600)),  # the user's umask still applies
])
def test_run_folder_modes(tmp_path, mode, umask, expected):
    old = os.umask(umask)
    try:
        recipe = resolve(small_recipe(run_dir_mode=mode))
        run = new_run(recipe, tmp_path / "runs", "local", "modes.yaml")
        assert _modes(run.path) == expected
        run.update(event="again", state="RUNNING")  # a rewrite keeps the mode
        assert _modes(run.path) == expected
        atomic_write(run.records_dir / "rank00000.jsonl", "{}\n")
        assert stat.S_IMODE((run.records_dir / "rank00000.jsonl").stat().st_mode) == expected[2]
    finally:
        os.umask(old)


def test_run_dir_mode_must_leave_the_owner_rwx():
    from hpc_tools.errors import RecipeError

    for bad in ("0644", "0555", "755x", "07555"):
        with pytest.raises(RecipeError, match="run_dir_mode"):
            resolve(small_recipe(run_dir_mode=bad))
    assert resolve(small_recipe(run_dir_mode=0o750)).cluster.run_dir_mode == "0750"  # YAML's 0750 is an octal int


def test_git_tree_dirty_flag_and_diff_hash(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    clean = git_tree(tmp_path)
    assert clean["git_sha"] and clean["git_dirty"] is False and clean["git_diff_sha256"] is None
    (tmp_path / "a.py").write_text("x = 2\n")
    dirty = git_tree(tmp_path)
    assert dirty["git_dirty"] is True and len(dirty["git_diff_sha256"]) == 64
    assert git_tree(tmp_path) == dirty  # the same change, the same hash
    (tmp_path / "a.py").write_text("x = 3\n")
    assert git_tree(tmp_path)["git_diff_sha256"] != dirty["git_diff_sha256"]
    assert git_tree(tmp_path / "missing") == {"git_sha": None, "git_dirty": None, "git_diff_sha256": None}


def test_manifest_records_the_git_tree(tmp_path):
    run = new_run(resolve(small_recipe()), tmp_path / "runs", "local", "git.yaml")
    manifest = run.manifest()
    assert {"git_sha", "git_dirty", "git_diff_sha256"} <= set(manifest)
    assert manifest["git_dirty"] in (True, False, None)


@pytest.mark.slurm_client
def test_dry_run_for_slurm_needs_no_controller(tmp_path):
    """A controller that does not answer (Slurm's client on PATH, as stand-ins that answer as it does without a
    cluster): the dry run still prints the script; a real submission is refused in one line, nothing written."""
    from tests.unit.test_slurm_hermetic import client_without_controller

    env = client_without_controller(tmp_path)
    runs = tmp_path / "runs"
    for executor in ("slurm", "auto"):
        dry = run_cli("submit", COMM, "--executor", executor, "--dry-run", "--runs-dir", str(runs), env=env)
        assert dry.returncode == 0, dry.stderr
        assert "#SBATCH --nodes=2" in dry.stdout and "srun --kill-on-bad-exit=1" in dry.stdout
    real = run_cli("submit", COMM, "--executor", "slurm", "--runs-dir", str(runs), env=env)
    assert real.returncode == 2 and "does not answer" in real.stderr, real.stderr
    assert not runs.exists() or not any(runs.iterdir())


def test_logs_rank_picks_a_file_or_the_labelled_lines(tmp_path):
    run = new_run(resolve(small_recipe()), tmp_path / "runs", "local", "logs.yaml")  # 2 ranks
    (run.logs_dir / "rank00000.out").write_text("zero\n")
    (run.logs_dir / "rank00001.out").write_text("one\n")
    out = io.BytesIO()
    copy_new(run, 1, {}, out)
    assert out.getvalue() == b"one\n"

    batch = tmp_path / "setup-4242.out"  # a plain sbatch job: one log, every rank's lines labelled
    batch.write_text("hpc_tools: run folder x\n0: zero a\n1: one a\n0: zero b\n1: one b\nhpc_tools: run ended\n")
    for name in ("rank00000.out", "rank00001.out"):
        (run.logs_dir / name).unlink()
    run.update(batch_log=str(batch), executor="sbatch")
    for rank, expected in ((1, b"one a\none b\n"), (0, b"zero a\nzero b\n"), (None, batch.read_bytes())):
        out = io.BytesIO()
        copy_new(run, rank, {}, out)
        assert out.getvalue() == expected, rank
    # following: a line still being written waits for its end
    offsets, out = {}, io.BytesIO()
    with open(batch, "a") as f:
        f.write("1: half")
    copy_new(run, 1, offsets, out, final=False)
    assert out.getvalue() == b"one a\none b\n"
    with open(batch, "a") as f:
        f.write(" done\n")
    copy_new(run, 1, offsets, out, final=False)
    assert out.getvalue() == b"one a\none b\nhalf done\n"

    told = run_cli("logs", str(run.path), "--rank", "2")  # beyond the run's ranks: the run says which it has
    assert told.returncode == 2 and "--rank 2 is not a rank of run" in told.stderr and "0..1" in told.stderr
    assert not told.stdout
    told = run_cli("logs", str(run.path), "--rank", "-1")  # no rank of any run: refused by the argument's type
    assert told.returncode == 2 and "argument --rank: '-1' is below 0" in told.stderr
    assert len(told.stderr.strip().splitlines()) == 1 and not told.stdout


def test_label_filter_reads_padded_labels():
    # srun pads labels to the width of the largest task id: " 1: " next to "11: "
    assert label_filter(1)(b" 1: a\n11: b\n 0: c\nplain\n 1: d") == b"a\nd"
    assert label_filter(11)(b" 1: a\n11: b\n") == b"b\n"
