"""Entry point of every rank: ``python -m hpc_tools.runtime.rank --run-dir RUN``.

The rendered sbatch script starts it with srun (one task per GPU), submitit calls ``run_rank`` in each task, and the
local executor spawns it once per rank: the same code on every path.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from hpc_tools import backends
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_resolved
from hpc_tools.registry import RunFolder, now_iso
from hpc_tools.runstate import HANG_EXIT_CODE, note_restart
from hpc_tools.runtime import elastic, forkserver
from hpc_tools.runtime.context import RankContext
from hpc_tools.runtime.distenv import DistEnv
from hpc_tools.runtime.hang_bounds import Bounds
from hpc_tools.runtime.preemption import StopFlag
from hpc_tools.runtime.preflight import leave_out
from hpc_tools.runtime.preflight import run as preflight
from hpc_tools.runtime.preflight.verdict import PreflightFailed
from hpc_tools.runtime.process_end import exit_process
from hpc_tools.runtime.ranklog import DATEFMT, FORMAT, RankLog
from hpc_tools.runtime.watchdog import HANG_DIR, HangVerdict, Watchdog


def setup_logging(rank: int, run_dir: str | None = None) -> RankLog:
    """Log lines to stdout; library warnings (once each) and detail lines to the rank's log file only."""
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True, format=FORMAT.format(rank=rank),
                        datefmt=DATEFMT)
    log = RankLog(run_dir, rank)
    forkserver.replay_warnings()  # a forked rank: what its libraries' imports warned in the fork server
    return log


def build_context(run_dir: str) -> RankContext:
    run = RunFolder(run_dir)
    recipe = load_resolved(run.recipe_path)
    dist = DistEnv.from_environ()
    dist.export()
    layout = ParallelLayout.from_recipe(recipe)
    full_nodes = recipe.cluster.nodes
    if layout.world_size != dist.world_size:
        fewer = elastic.for_world(run, recipe, dist.world_size)  # an elastic run's step on fewer nodes
        if fewer is None:
            raise SystemExit(f"the launcher started {dist.world_size} ranks but {run.recipe_path} needs "
                             f"{layout.world_size} (cluster.nodes x cluster.gpus_per_node); resubmit the recipe")
        recipe, layout = fewer, ParallelLayout.from_recipe(fewer)
    ctx = RankContext(recipe=recipe, layout=layout, dist=dist, run=run, stop=StopFlag().install(),
                      full_nodes=full_nodes)
    if recipe.cluster.uses_gpus:
        nccl_flight_recorder(run.path)
    bounds = Bounds.of_cluster(recipe.cluster.hang_timeout_min, run.path, dist.world_size)  # null: calibrated
    ctx.watchdog = Watchdog(bounds.cap_s, run.path, dist.rank, world_size=dist.world_size, restart=dist.restart_count,
                            on_hang=lambda v: record_hang(run, v), bounds=bounds).start()
    return ctx


def nccl_flight_recorder(run_dir) -> None:
    """Turn on PyTorch's NCCL flight recorder (the last collectives of every process group), dumped into the run
    folder's ``hang/`` by the watchdog or on an NCCL timeout; variables the user set win."""
    prefix = str(run_dir / HANG_DIR / "nccl_trace_rank_")
    for name, value in (("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix), ("TORCH_FR_DUMP_TEMP_FILE", prefix)):
        os.environ.setdefault(name, value)
    (run_dir / HANG_DIR).mkdir(exist_ok=True)


def record_hang(run: RunFolder, verdict: HangVerdict) -> None:
    """The watchdog's verdict, in the manifest: state HANG, the culprit ranks and nodes, the one-line reason, and
    how it was found appended to ``hangs`` (phase, bound, seconds from the last progress to the verdict)."""
    hangs = [*(run.manifest().get("hangs") or []), {"at": now_iso(), **(verdict.detection or {}),
                                                     "ranks": verdict.culprits, "nodes": verdict.nodes}]
    run.update(event="hang", state="HANG", ended=now_iso(), exit_code=HANG_EXIT_CODE, reason=verdict.line,
               failed_ranks=verdict.culprits, failed_nodes=verdict.nodes, hangs=hangs, soft=True)


def run_rank(run_dir: str) -> int:
    """Run this rank's share of the job; returns the process exit code."""
    dist = DistEnv.from_environ()
    rank_log = setup_logging(dist.rank, run_dir)
    last_words: list[str] = []  # the log's last line: the peer this rank lost (``_lost_peer``)
    try:
        return _run_rank(run_dir, dist, last_words)
    finally:
        line = rank_log.warnings_line()
        if line:  # the one console line about them (rank 0's stdout is the console of a foreground run)
            logging.getLogger("hpc_tools").info("%s", line)
        for line in last_words:
            logging.getLogger("hpc_tools").error("%s", line)
        rank_log.close()


def _run_rank(run_dir: str, dist: DistEnv, last_words: list[str]) -> int:
    ctx = build_context(run_dir)
    if ctx.is_rank0:
        note_restart(ctx.run, dist.restart_count, dist.job_id)
        ctx.run.update(event="started", state="RUNNING", started=now_iso(), job_id=dist.job_id,
                       nodelist=os.environ.get("SLURM_JOB_NODELIST", socket.gethostname()),
                       restart_count=dist.restart_count, world_size=dist.world_size,
                       reason=None, failed_ranks=None, failed_nodes=None)  # a new life: no culprit yet
    t0 = time.perf_counter()
    code, error, detail, checked = 1, None, {}, None
    try:
        checked = preflight.run_in_job(ctx)  # cluster.preflight: the allocation checked before step 1
        backends.load(backends.of(ctx.recipe).trainer)(ctx)
        code = 0
    except leave_out.LeaveOut as exc:  # preflight named nodes a spare or a requeue can replace: the controller does
        code, error = exc.exit_code, str(exc)  # rank 0 recorded the event with the marker, before any rank ended
        mid_run = exc.event != leave_out.LeaveOut.event  # the health check's, mid-run (runtime/health.py)
        detail = {"types": ["HealthLeaveOut" if mid_run else "PreflightLeaveOut"], "where": exc.event.split()[0],
                  "step": None, "started": mid_run}
        logging.getLogger("hpc_tools").warning("%s", error)
        return code
    except PreflightFailed as exc:  # strict: one line naming the node, no traceback; the job stops
        error = str(exc)  # classified as infrastructure (hpc_tools.job.failure_class): the node is named, no restart
        detail = {"types": ["PreflightFailed"], "where": "preflight", "step": None, "started": False}
        if ctx.is_rank0:
            ctx.run.update(event="failed", state="FAILED", ended=now_iso(), error=error, soft=True)
        logging.getLogger("hpc_tools").error("%s", error)
        return exc.exit_code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        try:
            detail = exception_record(exc, ctx)
        except Exception:  # noqa: BLE001 - the record helps the restart decision; it never hides the error
            detail = {}
        if ctx.is_rank0:
            ctx.run.update(event="failed", state="FAILED", ended=now_iso(), error=error, soft=True)
        if _lost_peer(ctx, exc, detail, last_words):  # the log ends with the rank it lost, not the socket error
            return code
        raise
    finally:
        if ctx.watchdog:  # the heartbeat's exit record: how this rank ended, for the batch script's epilogue
            ctx.watchdog.stop(exit_code=code, error=error, **detail)
        if code == 0 and checked is not None:
            preflight.close()  # the process group preflight made and the trainer used
    if ctx.is_rank0 and not ctx.stop_requested:
        ctx.run.update(event="completed", state="COMPLETED", ended=now_iso(), wall_s=round(time.perf_counter() - t0, 3))
    return 0


def _lost_peer(ctx: RankContext, exc: BaseException, detail: dict, last_words: list[str]) -> bool:
    """A collective that failed because a peer died: its traceback now, and into ``last_words`` one line naming the
    rank lost and where (``runtime.peer_loss``), for the end of the log; False for any other error (raised as it
    is)."""
    from hpc_tools.runtime.peer_loss import lost_peer_line

    try:
        line = lost_peer_line(ctx.run.path, ctx.rank, ctx.dist.restart_count, exc, detail.get("where", ""),
                              detail.get("step"))
    except Exception:  # noqa: BLE001 - naming the peer must never hide the error itself
        return False
    if line is None:
        return False
    log = logging.getLogger("hpc_tools")
    log.warning("a collective failed on a lost connection:\n%s", "".join(traceback.format_exception(exc)).rstrip())
    last_words.append(line)
    return True


def exception_record(exc: BaseException, ctx: RankContext) -> dict:
    """What the restart controller classifies a failure by (``hpc_tools.job.failure_class``), kept in the heartbeat's
    exit record: the exception's class and bases (``types``), the traceback's innermost frame (``where``), the last
    step this start completed (``step``; ``started``: whether it completed one) and, for the fix line of an
    out-of-memory error, the recipe's memory knobs."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno} in {tb[-1].name}" if tb else ""
    dog = ctx.watchdog
    training = ctx.recipe.training
    return {"types": [c.__name__ for c in type(exc).__mro__ if c not in (object, BaseException, Exception)],
            "where": where, "step": dog.beat_record.step if dog else None,
            "started": dog.started_step is not None if dog else None,
            "knobs": {"training.micro_batch_size": training.micro_batch_size,
                      "training.recompute_granularity": training.recompute_granularity}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.runtime.rank", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run folder holding recipe.yaml and manifest.json")
    parser.add_argument("--preflight-only", action="store_true",
                        help="run the recipe's preflight checks (whatever cluster.preflight says) and no training: "
                             "`python -m hpc_tools preflight`")
    args = parser.parse_args(argv)
    if args.preflight_only:
        return preflight_only(args.run_dir)
    return run_rank(args.run_dir)


def preflight_only(run_dir: str) -> int:
    """This rank's share of ``hpc_tools preflight``: the checks and the table (``preflight.json``), no training;
    0 whatever the verdict (the command reads the table), 1 when a rank fails to measure at all."""
    dist = DistEnv.from_environ()
    rank_log = setup_logging(dist.rank, run_dir)
    ctx = build_context(run_dir)
    code, error = 1, None
    try:
        preflight.check(ctx, "strict")
        code = 0
    except PreflightFailed as exc:  # this rank could not take part (its transport): the line, for the command
        error = str(exc)
        logging.getLogger("hpc_tools").error("%s", error)
        return exc.exit_code
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if ctx.watchdog:
            ctx.watchdog.stop(exit_code=code, error=error)
        if code == 0:
            preflight.close()
        rank_log.close()
    return code


if __name__ == "__main__":  # the guard matters: dist_checkpointing starts a spawn Manager that re-imports __main__
    exit_process(main())
