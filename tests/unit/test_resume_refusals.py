"""`resume`: what it refuses (one line, exit 2, nothing written), what it plans, and what it writes before the new
life starts; the Slurm paths with sbatch and submitit stubbed at their one call (the real cluster is in
tests/integration/test_resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hpc_tools.runstate as runstate
from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.errors import UserError
from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder
from hpc_tools.resume import launch, plan_resume
from hpc_tools.runstate import SacctReader
from hpc_tools.runtime.distenv import RESTART_BASE_ENV, DistEnv
from hpc_tools.submission import new_run
from tests.helpers import REPO, run_cli, srun_on_path

ITERS = 12


@pytest.fixture(autouse=True)
def quiet_slurm(monkeypatch):
    """No real sacct: Slurm knows only the jobs a test names (job id -> sacct line)."""
    known: dict[str, str] = {}
    monkeypatch.setattr(runstate, "READER", SacctReader(
        max_age_s=0, query=lambda ids: "".join(known[i] for i in ids if i in known)))
    return known


def make_run(root: Path, state: str = "FAILED", executor: str = "local", checkpoint: int | None = 6,
             steps: int = 8, **manifest) -> RunFolder:
    recipe = load_recipe(REPO / "recipes" / "gpt_3d.yaml", [f"training.train_iters={ITERS}"], profile="local")
    run = new_run(recipe, root, executor, source="recipes/gpt_3d.yaml")
    run.update(event="test", state=state, **manifest)
    with open(run.records_dir / "rank00000.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "restart": 0, "loss": 1.0}) + "\n")
    if checkpoint:
        dirs = CheckpointDirs(run.checkpoints_dir)
        (dirs.begin(checkpoint) / "model.bin").write_bytes(b"x" * 100)
        dirs.commit(checkpoint)
    return run


def snapshot(run: RunFolder) -> dict[str, bytes]:
    return {str(p.relative_to(run.path)): p.read_bytes() for p in sorted(run.path.rglob("*")) if p.is_file()}


def refused(run: RunFolder, *args, **kw) -> str:
    """The refusal's message, after checking that nothing was written but Slurm's view (``runstate.refresh``, what
    `status` records too)."""
    before, events = snapshot(run), run.manifest()["events"]
    with pytest.raises(UserError) as err:
        plan_resume(str(run.path), *args, **kw)
    after = snapshot(run)
    if after["manifest.json"] != before["manifest.json"]:
        added = run.manifest()["events"][len(events):]
        assert added and all(e["event"].startswith("slurm ") for e in added), added
        after["manifest.json"] = before["manifest.json"]
    assert after == before, "a refused resume wrote something"
    message = str(err.value)
    assert "\n" not in message
    return message


def test_refuses_a_live_local_run(tmp_path):
    run = make_run(tmp_path, state="RUNNING")
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "hpc_tools.runtime.rank",
                             "--run-dir", str(run.path)])
    try:
        run.update(pids=[rank.pid])
        message = refused(run)
    finally:
        rank.kill()
        rank.wait()
    assert "still live" in message and f"python -m hpc_tools cancel {run.run_id}" in message
    # Once its ranks are gone, a run its launcher never marked ended is resumable.
    assert plan_resume(str(run.path)).from_step == 6


def test_refuses_a_slurm_job_that_slurm_still_holds(tmp_path, quiet_slurm):
    # The ranks reported PREEMPTED, but Slurm requeued the job: it is live, whatever the manifest says.
    run = make_run(tmp_path, state="PREEMPTED", executor="slurm", job_id="4242")
    quiet_slurm["4242"] = "4242|PENDING|0:0|00:00:00|None assigned\n"
    assert "Slurm job 4242 is PENDING" in refused(run)
    quiet_slurm["4242"] = "4242|CANCELLED by 0|0:15|00:01:00|n1\n"
    plan = plan_resume(str(run.path), executor="local")  # ended: resumable (here, on this machine)
    assert (plan.previous["job_id"], plan.previous["state"]) == ("4242", "CANCELLED")


def test_refuses_a_run_that_completed_every_step(tmp_path):
    run = make_run(tmp_path, state="COMPLETED", steps=ITERS)
    assert f"completed all {ITERS} steps" in refused(run)


def test_refuses_a_run_without_a_checkpoint_and_suggests_a_fresh_submit(tmp_path):
    run = make_run(tmp_path, checkpoint=None)
    message = refused(run)
    assert "no complete checkpoint" in message and "python -m hpc_tools submit" in message


def test_skips_a_checkpoint_whose_files_lost_bytes(tmp_path):
    run = make_run(tmp_path, checkpoint=3)
    dirs = CheckpointDirs(run.checkpoints_dir, keep_last=4)
    (dirs.begin(6) / "model.bin").write_bytes(b"x" * 100)
    dirs.commit(6)
    (dirs.final_path(6) / "model.bin").write_bytes(b"x" * 10)  # truncated after the save
    plan = plan_resume(str(run.path))
    assert plan.from_step == 3 and "model.bin" in plan.skipped[0]


def test_refuses_unsafe_overrides_and_misplaced_options(tmp_path):
    run = make_run(tmp_path)
    assert "resume may change only cluster.time_limit" in refused(run, overrides=["training.train_iters=100"])
    assert "--exclude" in refused(run, exclude="n2")  # a local run has no nodes to exclude


def test_plan_counts_restarts_on_and_applies_safe_overrides(tmp_path):
    run = make_run(tmp_path, restart_count=2)
    plan = plan_resume(str(run.path), overrides=["cluster.time_limit=00:45:00"])
    assert (plan.executor, plan.from_step, plan.restart) == ("local", 6, 3)
    assert plan.env == {RESTART_BASE_ENV: "3"}
    assert plan.recipe.cluster.time_limit == "00:45:00" and "00:45:00" in plan.recipe_text


def test_restart_base_adds_to_slurms_requeue_count():
    env = {"RANK": "0", "WORLD_SIZE": "1", "SLURM_RESTART_COUNT": "1", RESTART_BASE_ENV: "2"}
    assert DistEnv.from_environ(env).restart_count == 3


def test_sbatch_path_reuses_the_folder_and_keeps_the_history(tmp_path, monkeypatch):
    import hpc_tools.executors.slurm as slurm

    run = make_run(tmp_path, state="CANCELLED", executor="sbatch", job_id="77", cancel_requested="earlier",
                   reason="rank 2 on n2 was killed by signal 9 at step 8")
    (run.path / "HANG.txt").write_text("rank 1 stopped\n")
    with open(run.records_dir / "rank00000.jsonl", "a") as f:
        f.write('{"step": 9, "resta')  # a rank killed mid-write
    calls = []
    monkeypatch.setattr(slurm, "slurm_available", lambda: (True, ""))
    monkeypatch.setattr(slurm, "sbatch_script", lambda script, env, options, cwd=None: calls.append(
        (script, env, options)) or "78")
    job_id, _ = launch(plan_resume(str(run.path), exclude="n2", overrides=["cluster.time_limit=00:20:00"]))
    script, env, options = calls[0]
    assert job_id == "78" and script == run.path / "job.sbatch"
    assert env == {"HPC_TOOLS_RUN_DIR": str(run.path), RESTART_BASE_ENV: "1"}
    assert "--exclude=n2" in options and "--time=00:20:00" in options
    manifest = run.manifest()
    assert (manifest["state"], manifest["job_id"], manifest["restart_count"]) == ("PENDING", "78", 1)
    assert manifest["cancel_requested"] is None and manifest["reason"] is None
    resumed = [e for e in manifest["events"] if e["event"] == "resumed"]
    assert [(e["previous_job_id"], e["job_id"]) for e in resumed] == [("77", "78")]
    history = manifest["resumes"][-1]
    assert (history["previous_job_id"], history["job_id"], history["previous_state"]) == ("77", "78", "CANCELLED")
    assert not (run.path / "HANG.txt").exists() and (run.path / "history" / "restart0" / "HANG.txt").is_file()
    assert (run.records_dir / "rank00000.jsonl").read_bytes().endswith(b"\n")
    # The new life ends on its own terms: its first terminal state stands.
    assert run.update(state="COMPLETED")["state"] == "COMPLETED"


def test_a_refused_resubmission_gives_the_run_its_ended_state_back(tmp_path, monkeypatch):
    import hpc_tools.executors.slurm as slurm

    run = make_run(tmp_path, state="TIMEOUT", executor="sbatch", job_id="90")

    def refuse(*a, **kw):
        raise subprocess.CalledProcessError(1, "sbatch", stderr="sbatch: error: invalid node name n9\n")

    monkeypatch.setattr(slurm, "slurm_available", lambda: (True, ""))
    monkeypatch.setattr(slurm, "sbatch_script", refuse)
    with pytest.raises(UserError, match="invalid node name n9"):
        launch(plan_resume(str(run.path), exclude="n9"))
    assert run.manifest()["state"] == "TIMEOUT"


def test_submitit_script_carries_the_exclusion_and_the_restart_base(tmp_path):
    from hpc_tools.executors.slurm import make_executor

    recipe = load_recipe(REPO / "recipes" / "gpt_3d.yaml", profile="local")
    with srun_on_path():
        executor = make_executor(recipe, tmp_path, exclude="n2", env={RESTART_BASE_ENV: "1"})
    text = executor._make_submission_file_text("python -c pass", "uid")
    assert "#SBATCH --exclude=n2" in text and f"export {RESTART_BASE_ENV}=1" in text
    assert text.index(f"export {RESTART_BASE_ENV}=1") < text.index("srun")


def test_cli_refusal_is_one_line_with_exit_code_2(tmp_path):
    run = make_run(tmp_path, checkpoint=None)
    out = run_cli("resume", run.run_id, "--runs-dir", str(tmp_path))
    assert out.returncode == 2 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr


def test_refuses_when_the_files_the_job_reads_are_gone(tmp_path):
    """The resumed job would read its data files again: gone since the first start -> the same one-line refusal as
    `submit`, nothing written. A vanished init_from_hf folder does not matter (the weights come from the checkpoint)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to train on\n" * 50)
    hf = tmp_path / "hf"
    hf.mkdir()
    recipe = load_recipe(REPO / "recipes" / "gpt_3d.yaml", [f"training.train_iters={ITERS}", "data.source=files",
                                                            f"data.paths=[{corpus}]"], profile="local")
    recipe.checkpoint.init_from_hf = str(hf)  # as if the first start had loaded these weights
    run = new_run(recipe, tmp_path / "runs", "local", source="recipes/gpt_3d.yaml")
    run.update(event="test", state="FAILED")
    dirs = CheckpointDirs(run.checkpoints_dir)
    (dirs.begin(6) / "model.bin").write_bytes(b"x" * 100)
    dirs.commit(6)
    hf.rmdir()
    assert plan_resume(str(run.path)).from_step == 6  # the data is there: resumable
    corpus.unlink()
    message = refused(run)
    assert "data.paths[0]" in message and "does not exist" in message and "init_from_hf" not in message


@pytest.mark.slurm_client
def test_waits_for_a_cancelled_job_to_finish_completing(tmp_path, quiet_slurm, monkeypatch):
    """Slurm says CANCELLED at once while the job's processes are still being stopped (squeue: COMPLETING); their
    last checkpoint and manifest writes must land before the new life begins, so resume waits for them, and refuses
    in one line when they outlast its wait."""
    import hpc_tools.resume as resume

    run = make_run(tmp_path, state="PREEMPTED", executor="slurm", job_id="4243")
    quiet_slurm["4243"] = "4243|CANCELLED by 0|0:15|00:01:00|n1\n"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    # squeue says COMPLETING for its first two answers, then no longer lists the job
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho x >> {calls}\n"
                                    f"[ $(wc -l < {calls}) -le 2 ] && echo COMPLETING\nexit 0\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    plan = plan_resume(str(run.path), executor="local")
    assert plan.previous["state"] == "CANCELLED" and len(calls.read_text().split()) == 3
    calls.write_text("")
    (bin_dir / "squeue").write_text("#!/bin/sh\necho COMPLETING\n")
    monkeypatch.setattr(resume, "COMPLETING_WAIT_S", 1.5)
    message = refused(run, executor="local")
    assert "Slurm job 4243 is CANCELLED but still COMPLETING" in message and "still live" in message
