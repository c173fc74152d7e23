"""What `resume` does: continue an ended run in its own folder from its newest complete checkpoint.

A run that failed, was cancelled, timed out or hung keeps its folder: recipe, checkpoints, records and manifest.
Resuming starts a new life of the same run: the same executor it ran on (the manifest's ``executor``: submitit
``slurm``, plain ``sbatch`` of the run's own script, or ``local``), the same recipe (only the supervision fields in
``SAFE_OVERRIDES`` may change), the trainer's own resume rule (``checkpoint_dirs.resume_source``: the newest complete
checkpoint of the run), and records appended with the next restart number (``HPC_TOOLS_RESTART_BASE``, read by
``hpc_tools.runtime.distenv.restart_count``), so that the analysis keeps the newest start's record of every step.

Refused, in one line with exit code 2 and nothing written: a run that is still live (Slurm's word first, then the
run state of ``hpc_tools.runstate``), a run that completed all its steps, and a run without a checkpoint of its own.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from hpc_tools.errors import UserError
from hpc_tools.recipe.load import dump_resolved, resolve
from hpc_tools.recipe.schema import Recipe
from hpc_tools.recipe.yamlfile import parse_yaml
from hpc_tools.registry import RunFolder, atomic_write, now_iso, resolve_run
from hpc_tools.runtime.distenv import RESTART_BASE_ENV
from hpc_tools.runtime.process_end import pid_alive

EXECUTORS = ("auto", "local", "slurm", "sbatch")
# Fields a resume may change: how the job is supervised, never what it computes (model, layout, data, schedule).
SAFE_OVERRIDES = ("cluster.time_limit", "cluster.signal_delay_s", "cluster.hang_timeout_min")
HISTORY = "history"  # run-folder subfolder where an ended life's hang markers are kept


@dataclass
class ResumePlan:
    """A checked resume, ready to launch: nothing has been written yet."""

    run: RunFolder
    recipe: Recipe
    executor: str  # local | slurm | sbatch
    checkpoint: Path
    from_step: int
    restart: int
    previous: dict[str, Any]  # the ended life: state, reason, job id
    overrides: list[str] = field(default_factory=list)
    exclude: str | None = None
    recipe_text: str | None = None  # the new recipe.yaml when overrides changed it
    skipped: list[str] = field(default_factory=list)  # newer checkpoints that fail the size check, with the file

    @property
    def env(self) -> dict[str, str]:
        """What every rank of the new life gets in its environment."""
        return {RESTART_BASE_ENV: str(self.restart)}


# -- checks ------------------------------------------------------------------------------------------------------------
def _pid_runs_rank(pid: int, run_dir: Path) -> bool:
    """Whether ``pid`` is alive and (where /proc tells) still a rank program of this run folder (pids are reused)."""
    if not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    return b"hpc_tools.runtime.rank" in cmdline and str(run_dir).encode() in cmdline


def live_reason(run: RunFolder, manifest: dict[str, Any]) -> str | None:
    """Why the run is still live (to refuse a resume), or None when its life has ended.

    For a Slurm job Slurm's own state decides when sacct knows the job (a requeued job is live although its ranks
    reported PREEMPTED); otherwise ``runstate.classify``. A local run recorded as live whose rank processes are all
    gone (its launcher was killed) has ended.
    """
    from hpc_tools.runstate import READER, classify, is_terminal, on_slurm

    job = READER.job(str(manifest["job_id"])) if on_slurm(manifest) else None
    if job is not None and job.state:
        if not is_terminal(job.state):
            return f"Slurm job {job.job_id} is {job.slurm_state}"
        return None if processes_gone(job.job_id) else (
            f"Slurm job {job.job_id} is {job.slurm_state} but still COMPLETING after {COMPLETING_WAIT_S:.0f} s: its "
            "processes may still write the run folder")
    verdict = classify(run, job, manifest)
    if verdict.status not in ("pending", "running"):
        return None
    if manifest.get("executor") == "local" and not any(_pid_runs_rank(p, run.path) for p in manifest.get("pids") or []):
        return None if manifest.get("pids") else "it has not started yet"
    return f"{verdict.status}: {verdict.reason}"


# Slurm reports a cancelled job CANCELLED at once, while its processes are still being signalled (squeue: COMPLETING,
# up to the cluster's KillWait, 30 s by default, then its epilog): the ranks' last checkpoint and manifest writes can
# come after that. A resume waits this long for them to be gone, so that they land in the ended life, not the new one.
COMPLETING_WAIT_S = 90.0


def processes_gone(job_id: str, poll_s: float = 1.0) -> bool:
    """True once squeue no longer lists job ``job_id`` as COMPLETING (or cannot say); False after
    ``COMPLETING_WAIT_S``."""
    import time

    from hpc_tools import slurm_client

    deadline = time.monotonic() + COMPLETING_WAIT_S
    while True:
        if "COMPLETING" not in (slurm_client.job_state(job_id, timeout=30) or "").split():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def newest_verified(dirs) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint whose files all have their recorded sizes (a cheap stat of each file; the
    job verifies checksums too when it loads, and sets a bad one aside), and one line per newer one skipped."""
    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.checkpoints.verify import verify_share

    skipped: list[Path] = []
    lines: list[str] = []
    while (path := dirs.newest(skip=skipped)) is not None:
        problems = verify_share(path, CheckpointDirs.read_meta(path), 0, 1, checksum=False).problems
        if not problems:
            return path, lines
        skipped.append(path)
        lines.append(problems[0].line(path))
    return None, lines


def _check_overrides(overrides: Iterable[str]) -> list[str]:
    out = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or key not in SAFE_OVERRIDES:
            raise UserError(f"--set {item}: resume may change only {', '.join(SAFE_OVERRIDES)} (SECTION.KEY=VALUE); "
                            "a run with another model, layout or schedule is a new run: submit it")
        out.append(item)
    return out


# What a resumed job no longer reads: its weights come from its own newest checkpoint.
_NOT_READ_ON_RESUME = ("checkpoint.load_path", "checkpoint.init_from_hf")


def _check_world(recipe, executor: str, source: str) -> None:
    """The files the resumed job will read (its data, tokenizer) and, on Slurm, the partition it asks for must still
    be there: the same checks as `submit` (``recipe.world``), before anything is queued. Relative paths are read from
    this folder, where a local or submitit job runs; a re-submitted job.sbatch runs from its first submission's
    folder, so its files are left to the job."""
    from hpc_tools.errors import RecipeError
    from hpc_tools.world import path_violations, slurm_view, slurm_violations

    found = []
    if executor != "sbatch":
        found += [v for v in path_violations(recipe) if v.path not in _NOT_READ_ON_RESUME]
    if executor != "local":
        view = slurm_view()
        if view.checked:
            found += slurm_violations(recipe, view)
    if found:
        raise RecipeError(found, source)


def _resume_executor(run, manifest: dict, executor: str, exclude: str | None) -> str:
    """The executor a resume submits with (``auto``: the one the run recorded), refused in one line where it cannot
    (no job.sbatch to resubmit, ``--exclude`` on this machine, Slurm not answering)."""
    chosen = (manifest.get("executor") or "local") if executor == "auto" else executor
    if chosen not in ("local", "slurm", "sbatch"):
        raise UserError(f"run {run.run_id} records executor {chosen!r}; resume it with --executor local or slurm")
    if chosen == "sbatch" and not (run.path / "job.sbatch").is_file():
        raise UserError(f"run {run.run_id} has no job.sbatch to resubmit; use --executor slurm")
    if chosen == "local" and exclude:
        raise UserError("--exclude names Slurm nodes; it needs --executor slurm or sbatch")
    if chosen != "local":  # the one executor rule: Slurm that does not answer is one line, nothing written
        from hpc_tools.submission import choose_executor

        choose_executor("slurm")
    return chosen


def plan_resume(ref: str, runs_dir: str | Path | None = None, executor: str = "auto", exclude: str | None = None,
                overrides: Iterable[str] = ()) -> ResumePlan:
    """Check that run ``ref`` can be resumed and how; raises UserError (nothing written) when it cannot."""
    from hpc_tools.checkpoints.dirs import CheckpointDirs, parse_step
    from hpc_tools.runstate import classify, last_step, refresh

    if executor not in EXECUTORS:
        raise UserError(f"--executor {executor} is unknown (use one of {', '.join(EXECUTORS)})")
    overrides = _check_overrides(overrides)
    run = resolve_run(ref, runs_dir)
    manifest = refresh(run)
    live = live_reason(run, manifest)
    if live:
        raise UserError(f"run {run.run_id} is still live ({live}); wait for it to end, or stop it with "
                        f"`python -m hpc_tools cancel {run.run_id}` and then resume it")
    recipe_text = run.recipe_path.read_text()
    recipe = resolve(parse_yaml(recipe_text, str(run.recipe_path)), overrides, source=str(run.recipe_path),
                     layered=False)
    if not recipe.checkpoint.resume:  # the trainer would start over at step 1 in the same folder
        overrides.append("checkpoint.resume=true")
        recipe = resolve(parse_yaml(recipe_text, str(run.recipe_path)), overrides, source=str(run.recipe_path),
                         layered=False)
    verdict = classify(run, None, manifest)
    tail = last_step(run) or {}
    done = tail.get("step") or 0
    iters = recipe.training.train_iters
    fresh = f"submit it afresh with `python -m hpc_tools submit {run.recipe_path}`"
    if verdict.status == "completed" and done >= iters:
        raise UserError(f"run {run.run_id} completed all {iters} steps: nothing to resume ({fresh}, "
                        "or raise training.train_iters there)")
    ckpt_root = Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else run.checkpoints_dir
    dirs = CheckpointDirs(ckpt_root, recipe.checkpoint.keep_last)
    newest, skipped = newest_verified(dirs)
    if newest is None:
        bad = f" ({len(skipped)} fail the size check: {skipped[0]})" if skipped else ""
        raise UserError(f"run {run.run_id} has no complete checkpoint under {ckpt_root} to resume from{bad} "
                        f"(checkpoint.interval_iters={recipe.checkpoint.interval_iters}); {fresh}")
    from_step = parse_step(newest.name)
    if from_step >= iters:
        raise UserError(f"run {run.run_id}'s newest checkpoint ({newest.name}) holds its last step ({iters}): "
                        f"nothing to resume ({fresh})")
    chosen = _resume_executor(run, manifest, executor, exclude)
    _check_world(recipe, chosen, str(run.recipe_path))
    restart = max(int(manifest.get("restart_count") or 0), int(tail.get("restart") or 0)) + 1
    new_text = dump_resolved(recipe)
    return ResumePlan(run=run, recipe=recipe, executor=chosen, checkpoint=newest, from_step=from_step,
                      restart=restart, previous={"state": manifest.get("state"), "status": verdict.status,
                                                 "reason": verdict.reason, "job_id": manifest.get("job_id"),
                                                 "executor": manifest.get("executor"), "last_step": done},
                      overrides=overrides, exclude=exclude, skipped=skipped,
                      recipe_text=new_text if new_text != recipe_text else None)


# -- launching ---------------------------------------------------------------------------------------------------------
def _repair_record_tails(records_dir: Path) -> list[Path]:
    """End every JSON-lines file with a newline: a rank killed mid-write leaves a torn last line, and the new life's
    first record appended to it would be lost with it."""
    repaired = []
    for path in sorted(records_dir.glob("*.jsonl")) if records_dir.is_dir() else ():
        with open(path, "rb+") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                continue
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")
                repaired.append(path)
    return repaired


def _set_aside_hang_markers(plan: ResumePlan) -> list[Path]:
    """Move the ended life's hang verdict and stacks into ``history/restart<N>/``: they explain that life, not the
    new one (``runstate`` would read a verdict left in place as this life's)."""
    from hpc_tools.runstate import hang_markers
    from hpc_tools.runtime.watchdog import HANG_DIR

    stacks = plan.run.path / HANG_DIR
    markers = hang_markers(plan.run) + ([stacks] if stacks.is_dir() and any(stacks.iterdir()) else [])
    if not markers:
        return []
    dest = plan.run.path / HISTORY / f"restart{plan.restart - 1}"
    dest.mkdir(parents=True, exist_ok=True)
    moved = []
    for marker in markers:
        target = dest / marker.name
        shutil.move(str(marker), target)
        moved.append(target)
    return moved


def begin(plan: ResumePlan) -> dict[str, Any]:
    """Start the new life in the manifest (state PENDING, the ended life's outcome cleared and kept in ``resumes``);
    write the overridden recipe; set the old life's leftovers aside. Returns the history entry."""
    run = plan.run
    if plan.recipe_text is not None:
        text = plan.recipe_text
        if dump_resolved(resolve(parse_yaml(text), layered=False)) != text:
            raise RuntimeError("the resumed recipe did not survive a round trip through recipe.yaml")
        atomic_write(run.recipe_path, text)
    _repair_record_tails(run.records_dir)
    moved = _set_aside_hang_markers(plan)
    entry = {"requested": now_iso(), "restart": plan.restart, "from_step": plan.from_step,
             "checkpoint": plan.checkpoint.name, "executor": plan.executor, "previous_job_id": plan.previous["job_id"],
             "previous_state": plan.previous["state"], "previous_reason": plan.previous["reason"],
             "overrides": plan.overrides, "exclude": plan.exclude, "hang_markers_moved": [str(p) for p in moved]}
    run.update(resumes=list(run.manifest().get("resumes") or []) + [entry])  # the history, kept across resumes
    # A live state starts a new life (RunFolder.update): the ended life's verdict fields go (``resumes`` keeps them).
    run.update(event="resume requested", state="PENDING", restart_count=plan.restart, ended=None, exit_code=None,
               error=None, reason=None, failed_ranks=None, failed_nodes=None, slurm_state=None, slurm_exit_code=None,
               elapsed=None, cancel_requested=None, last_step=None, pids=None)
    return entry


def _note_job(plan: ResumePlan, job_id: str | None) -> None:
    """The new job id in the newest ``resumes`` entry."""
    history = list(plan.run.manifest().get("resumes") or [])
    if history:
        history[-1] = {**history[-1], "job_id": job_id}
        plan.run.update(resumes=history)


def _undo(plan: ResumePlan, why: str) -> None:
    """The resubmission failed: the run gets the ended life's state back, with the failure as an event."""
    from hpc_tools.runstate import is_terminal

    state = plan.previous["state"] if is_terminal(plan.previous["state"]) else "FAILED"
    plan.run.update(event=f"resume failed: {why}", state=state, ended=now_iso())


def launch(plan: ResumePlan, echo=None) -> tuple[str | None, object]:
    """Start the new life: (new Slurm job id, submitit job or None) on Slurm; (None, exit code) locally."""
    begin(plan)
    previous = plan.previous["job_id"]
    if plan.executor == "local":
        from hpc_tools.executors.local import run_local
        from hpc_tools.layout import ParallelLayout

        plan.run.update(event="resumed", executor="local", job_id=None, previous_job_id=previous)
        _note_job(plan, None)
        return None, run_local(plan.run, ParallelLayout.from_recipe(plan.recipe).world_size, echo=echo,
                               extra_env=plan.env)
    try:
        if plan.executor == "slurm":
            from hpc_tools.executors.slurm import submit_run

            job = submit_run(plan.run, plan.recipe, exclude=plan.exclude, env=plan.env, event="resumed",
                             state=None, previous_job_id=previous)
            job_id = str(job.job_id)
        else:
            job, job_id = None, _sbatch_again(plan)
    except Exception as exc:
        from hpc_tools.slurm_client import REFUSED, SlurmError

        message = " ".join((getattr(exc, "stderr", None) or str(exc)).split()) or type(exc).__name__
        _undo(plan, message)
        if isinstance(exc, SlurmError) and exc.kind != REFUSED:  # the client's one line: no Slurm, no controller
            raise exc from None
        if isinstance(exc, SlurmError):
            message = exc.args[0].split(": ", 1)[-1]  # Slurm's words, without the client's "Slurm refused X:"
        raise UserError(f"Slurm refused the resumed job: {message} (check --exclude and the cluster section "
                        "against `sinfo`)") from None
    _note_job(plan, job_id)
    return job_id, job


def _sbatch_again(plan: ResumePlan) -> str:
    """sbatch the run's own job.sbatch with its folder reused (HPC_TOOLS_RUN_DIR); command-line flags override the
    script's #SBATCH lines (time limit, excluded nodes). Slurm writes the batch log where the first job's went."""
    from hpc_tools.executors.slurm import sbatch_script
    from hpc_tools.render.slurm_params import STOP_SIGNAL, SlurmSpec

    spec = SlurmSpec.from_recipe(plan.recipe)
    options = [f"--time={spec.time_limit}", f"--signal={STOP_SIGNAL}@{spec.signal_delay_s}"]
    if plan.exclude:
        options.append(f"--exclude={plan.exclude}")
    batch_log = plan.run.manifest().get("batch_log")
    cwd = Path(batch_log).parent if batch_log and Path(batch_log).parent.is_dir() else plan.run.path
    job_id = sbatch_script(plan.run.path / "job.sbatch", {"HPC_TOOLS_RUN_DIR": str(plan.run.path), **plan.env},
                           options, cwd=cwd)
    plan.run.update(event="resumed", job_id=job_id, previous_job_id=plan.previous["job_id"], submitted=now_iso(),
                    executor="sbatch")
    return job_id
