"""cluster.launcher: ray without starting Ray: the rule (the PyTorch-native backend only, one line), the alias names
Ray Train users know, the rendered batch script's Ray block, the driver's ScalingConfig and the rank environment it
gives the rank program, the job's own Ray token, and the control plane's imports (never Ray).
tests/integration/test_ray_train.py runs it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hpc_tools import backends
from hpc_tools.errors import RecipeError
from hpc_tools.job import ray_launch
from hpc_tools.recipe.load import read_yaml, resolve
from hpc_tools.render.sbatch import render_sbatch
from tests.helpers import REPO

LLAMA = {"family": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 176, "seq_length": 32, "vocab_size": 512}
BASE = {"name": "r", "model": LLAMA, "training": {"micro_batch_size": 2, "global_batch_size": 64},
        "backend": {"kind": "fsdp"}, "cluster": {"nodes": 2, "gpus_per_node": 8, "launcher": "ray"}}


def recipe(*overrides: str):
    return resolve(BASE, list(overrides))


@pytest.mark.parametrize("strategy", ["full_shard", "hybrid_shard", "ddp"])
def test_ray_launches_every_fsdp_strategy(strategy):
    extra = ["backend.fsdp.shard_size=8"] if strategy == "hybrid_shard" else []
    assert recipe(f"backend.fsdp.strategy={strategy}", *extra).cluster.launcher == "ray"


@pytest.mark.parametrize("kind", ["megatron", "deepspeed", "horovod"])
def test_ray_refuses_other_backends_in_one_line(kind):
    with pytest.raises(RecipeError) as info:
        recipe(f"backend.kind={kind}")
    lines = [v for v in info.value.violations if v.path == "cluster.launcher"]
    assert len(lines) == 1, info.value.violations
    text = str(lines[0])
    assert "cluster.launcher=ray" in text and f"backend.kind={kind}" in text and "cluster.launcher: srun" in text
    assert "\n" not in text and backends.with_feature("ray_train") == ["fsdp"]


def test_ray_train_names_point_at_the_recipe_fields():
    from hpc_tools.recipe.aliases import find

    assert find(["max_failures"]).target == find(["failure_config", "max_failures"]).target == "cluster.restarts"
    assert find(["scaling_config", "num_workers"]).target is None  # derived: nodes x gpus_per_node
    assert find(["data", "num_workers"]) is None  # a DataLoader's word, not Ray Train's, outside scaling_config


def test_scaling_config_is_the_world_or_the_elastic_range():
    assert ray_launch.num_workers(recipe().cluster) == 16
    assert ray_launch.num_workers(recipe("cluster.min_nodes=1", "cluster.restarts=2").cluster) == (8, 16)
    assert ray_launch.num_workers(recipe("cluster.min_nodes=2").cluster) == 16  # min_nodes = nodes: not elastic


def test_rank_environment_is_what_distenv_reads():
    from hpc_tools.runtime.distenv import DistEnv

    context = SimpleNamespace(get_world_rank=lambda: 3, get_world_size=lambda: 4, get_local_rank=lambda: 1,
                              get_local_world_size=lambda: 2, get_node_rank=lambda: 1)
    base = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29555", "SLURM_JOB_ID": "77", "SLURM_PROCID": "0",
            "SLURM_NODEID": "1", "HPC_TOOLS_RESTART_BASE": "2"}
    env = ray_launch.rank_environment(context, base)
    assert "SLURM_PROCID" not in env and env["HPC_TOOLS_EXECUTOR"] == "slurm"
    dist = DistEnv.from_environ(env)
    assert (dist.rank, dist.world_size, dist.local_rank, dist.local_world_size, dist.node_rank) == (3, 4, 1, 2, 1)
    assert (dist.master_addr, dist.master_port, dist.job_id, dist.restart_count) == ("10.0.0.1", 29555, "77", 2)
    assert ray_launch.rank_environment(context, {})["HPC_TOOLS_EXECUTOR"] == "local"


def rank_steps(script: str) -> list[str]:
    return [line for line in script.splitlines() if "-m hpc_tools.runtime.rank" in line and not line.startswith("#")]


def test_the_ray_block_of_the_batch_script():
    script = render_sbatch(recipe("cluster.cpus_per_task=4", "cluster.restarts=2"))
    # one Ray node per node: the step's own task count, not the allocation's rank per GPU (without --ntasks, srun
    # asked for 16 tasks on 2 nodes of one CPU set each and refused the step)
    assert "srun --overlap --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=32 --mem=0 python3 -m " \
           "hpc_tools.job.ray_launch node" in script and "--num-cpus 32 --num-gpus 8" in script
    assert 'ray_launch drive --run-dir "$RUN_DIR" --address "$HPC_TOOLS_RAY_HEAD:$HPC_TOOLS_RAY_PORT"' in script
    assert "FailureConfig(max_failures=cluster.restarts=2)" in script
    assert not rank_steps(script)  # Ray Train starts the ranks, not srun
    native = render_sbatch(recipe("cluster.launcher=srun"))
    assert "ray_launch" not in native and rank_steps(native)
    cpu = render_sbatch(recipe("cluster.gpu_type=cpu", "cluster.gpus_per_node=2", "cluster.cpus_per_task=1"))
    assert "--num-cpus 2 --num-gpus 0" in cpu


def test_the_shipped_ray_recipe_renders_elastic():
    r = resolve(read_yaml(REPO / "recipes" / "llama_ray.yaml"))
    assert (r.cluster.launcher, r.cluster.fewest_nodes, r.cluster.nodes, r.cluster.restarts) == ("ray", 1, 2, 2)
    assert ray_launch.num_workers(r.cluster) == (8, 16)
    script = render_sbatch(r)
    assert "ray_launch node" in script and "--mem=0 --no-kill python3" in script  # a lost node leaves the others
    assert "--no-kill" not in render_sbatch(recipe())
    local = resolve(read_yaml(REPO / "recipes" / "llama_ray.yaml"), profile="local")
    assert (local.cluster.launcher, local.cluster.gpu_type, local.cluster.nodes) == ("ray", "cpu", 1)


def test_exports_derive_ports_and_write_an_owner_only_token(tmp_path):
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "stop").write_text("")  # from a previous life of a requeued job
    line = ray_launch.exports(str(tmp_path), {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu[07-08]"})
    gcs, dashboard = ray_launch.ray_ports("1234")
    assert line.startswith("export HPC_TOOLS_RAY_HEAD=gpu07 ") and f"HPC_TOOLS_RAY_PORT={gcs}" in line
    assert f"HPC_TOOLS_RAY_DASHBOARD_PORT={dashboard}" in line and "RAY_AUTH_MODE=token" in line
    token = tmp_path / "ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    assert not (tmp_path / "ray" / "stop").exists()
    before = token.read_text()
    ray_launch.exports(str(tmp_path), {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu07"})
    assert token.read_text() == before  # a requeued life keeps the job's token
    assert ray_launch.ray_ports("1235") != ray_launch.ray_ports("1234")
    assert len(ray_launch.ray_temp_dir("123456789", "a-rather-long-node-name-0001")) <= 60


def test_the_control_plane_never_imports_ray():
    """The commands, submission, rendering, the executors and the driver's own module import nothing of Ray: only
    the driver's process does, when it runs."""
    code = ("import sys, hpc_tools.__main__, hpc_tools.cli, hpc_tools.submission, hpc_tools.render.sbatch, "
            "hpc_tools.executors.local, hpc_tools.executors.slurm, hpc_tools.planner, hpc_tools.analysis, "
            "hpc_tools.job.ray_launch, hpc_tools.doctor\n"
            "from hpc_tools.cli import status, submit, validate, render, logs, report\n"
            "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
            "assert not bad, bad[:5]\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]


def test_submit_to_slurm_sends_the_rendered_script(tmp_path, monkeypatch):
    """submitit starts one task per rank, which Ray Train does here: `submit --executor slurm` sbatches the run's
    rendered script into its folder and records the job like submitit's."""
    from hpc_tools.executors import slurm
    from hpc_tools.submission import new_run

    r = recipe("cluster.partition=null")
    run = new_run(r, tmp_path, "slurm")
    calls = []
    monkeypatch.setattr(slurm, "sbatch_script", lambda script, env, options=(), cwd=None:
                        calls.append((script, env, list(options), cwd)) or "42")
    job = slurm.submit_run(run, r, exclude="n3", env={"HPC_TOOLS_RESTART_BASE": "1"})
    assert job.job_id == "42"
    ((script, env, options, cwd),) = calls
    assert script == run.path / "job.sbatch" and "ray_launch drive" in script.read_text()
    assert env == {"HPC_TOOLS_RUN_DIR": str(run.path), "HPC_TOOLS_RESTART_BASE": "1"} and options == ["--exclude=n3"]
    manifest = run.manifest()
    assert (manifest["job_id"], manifest["state"], manifest["launcher"], cwd) == ("42", "PENDING", "ray", run.path)
