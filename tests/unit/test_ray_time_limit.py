"""A Ray run at its time limit (issue 46 item 9): Slurm's stop signal reaches every process of the Ray node step, Ray's
own included, and ends them before any worker checkpoints; so a Ray job asks for no signal (and has no time-limit
requeue step), and ``validate`` says what happens at the limit instead. The srun launcher keeps both."""

from __future__ import annotations

from hpc_tools.recipe.load import load_recipe
from hpc_tools.render.sbatch import render_sbatch
from tests.helpers import REPO, run_cli


def test_a_ray_job_asks_for_no_stop_signal_and_requeues_nothing_at_the_limit():
    ray = render_sbatch(load_recipe(REPO / "recipes/llama_ray.yaml"), "recipes/llama_ray.yaml")
    srun = render_sbatch(load_recipe(REPO / "recipes/llama_fsdp.yaml"), "recipes/llama_fsdp.yaml")
    assert "#SBATCH --signal=USR2@180" in srun and "-m hpc_tools.job.requeue" in srun
    assert "#SBATCH --signal" not in ray, [ln for ln in ray.splitlines() if "--signal" in ln]
    assert "-m hpc_tools.job.requeue" not in ray
    assert "No stop signal is asked before the time limit" in ray


def test_validate_says_a_ray_run_gets_no_checkpoint_at_the_limit():
    out = run_cli("validate", "recipes/llama_ray.yaml", "--offline")
    assert out.returncode == 0, out.stderr
    notes = [ln for ln in out.stderr.splitlines() if ln.startswith("note: cluster.launcher=ray gets no stop signal")]
    assert len(notes) == 2, out.stderr  # the recipe and its local profile
    assert "checkpoint.interval_iters=500" in notes[0] and "`hpc_tools resume`" in notes[0]
    srun = run_cli("validate", "recipes/llama_fsdp.yaml", "--offline")
    assert "gets no stop signal" not in srun.stderr
