"""The one training loop every backend runs (Megatron, DeepSpeed, comm_check), driving a small ``Engine`` protocol.

What the loop owns, in this order for each step ``s`` of ``start+1 .. training.train_iters``::

    collector.start_step(s); batch = engine.batch(s) (timed as data time); result = engine.step(s, batch)
    collector.end_step(s, ...); ctx.heartbeat(s)
    if result.nonfinite: count it; past training.max_nonfinite_steps in a row raise NonFiniteError naming the step
    every training.eval_interval steps and at the last: val_loss = engine.evaluate(validation batches) (collective,
        after the step's time was taken; its loss and wall time join step s's record: ``val_loss``, ``eval_time_s``)
    at training.log_interval, the last step and evaluations: rank 0 logs the progress line (``progress.py``),
        writes ``progress.json`` and hands the scalars to the experiment trackers (``hpc_tools.tracking``)
    stop = ctx.agree_stop()                          # collective: every rank takes the same branch below
    save(s) if stop, or s is the last step, or s % checkpoint.interval_iters == 0 (at most one save per step),
        unless step s was non-finite (a checkpoint never holds what a non-finite step left behind)
    if stop: ctx.finish_preempted(s) and return      # the checkpoint of step s exists before the requeue

Rank 0 also logs the start-up phases (imports, process group, model build, checkpoint load, first step) once each.

Before the first step (``resume``): the resume source (``checkpoint_dirs.resume_source``) is verified on every rank
(``checkpoint_agree.agree``: sizes, and checksums unless ``checkpoint.verify: size``) and handed to
``engine.resume``, whose step the run continues from (steps are 1-based and continue across resumes; records are
appended). A checkpoint that fails verification is set aside (``CheckpointDirs.set_aside``), one that verified but
failed to load is skipped, and the next older complete one is tried; with none left the run fails naming the file.
Whatever happens, the collector is closed and then the engine, in a ``finally``. ``run`` adds the process group
around it all.

Non-finite steps: every engine decides ``StepResult.nonfinite`` the same way on every rank (an all-reduced flag) and
skips the update of such a step itself (before its optimizer step); the loop counts them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from hpc_tools.checkpoints.dirs import CheckpointDirs, parse_step, resume_source
from hpc_tools.errors import UserError

if TYPE_CHECKING:
    from hpc_tools.runtime.context import RankContext

log = logging.getLogger("hpc_tools")

INJECT_NONFINITE_ENV = "HPC_TOOLS_INJECT_NONFINITE"
"""Fault injection for tests only: ``"6,7"`` or ``"6,7@1"`` makes the engines poison the loss (and so the gradients)
of those steps, on every rank or only on rank 1."""


class NonFiniteError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm (training.max_nonfinite_steps)."""


class CheckpointError(RuntimeError):
    """Every checkpoint the run could resume from failed verification or loading."""


def nonfinite_injected(step: int, rank: int) -> bool:
    """Whether the test hook ``HPC_TOOLS_INJECT_NONFINITE`` asks to poison ``step`` on ``rank``."""
    spec = os.environ.get(INJECT_NONFINITE_ENV, "").strip()
    if not spec:
        return False
    steps, _, on = spec.partition("@")
    return str(step) in steps.split(",") and (not on or int(on) == rank)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step reports to the records (``profiling.collector.StepCollector.end_step``) and the log."""

    loss: float | None = None
    """Mean loss over the whole global batch (every microbatch, every data-parallel rank): the same on every rank.
    None for a step without a model (comm_check)."""
    grad_norm: float | None = None
    """Global gradient norm before clipping, when the backend computes one."""
    lr: float | None = None
    """Learning rate the optimizer step used."""
    skipped: bool | None = None
    """True when the optimizer skipped the update (fp16 loss-scale overflow, or a non-finite step); None when the
    backend cannot tell."""
    nonfinite: bool = False
    """The loss or the gradient norm of this step was not finite on some rank: the same on every rank (the engine
    all-reduces it) and the update was skipped where the backend can (see the engines)."""
    note: str | None = None
    """A progress detail of this step, logged by rank 0 every ``training.log_interval`` steps and at the last one."""
    figures: dict[str, Any] | None = None
    """Further record fields the backend measured in this step (``profiling.schema`` names), e.g. the MoE router's
    load (``moe_*``); None when it has none."""


class Engine(Protocol):
    """One rank's share of a job as the loop drives it. Every method except ``describe`` and ``coords`` may be a
    collective: all ranks call it at the same point."""

    checkpoints: bool
    """False for a backend without state to save (comm_check): the loop then neither resumes nor saves."""

    def describe(self) -> str:
        """One line for rank 0's log: backend, layout, precision..."""

    def coords(self) -> dict[str, int]:
        """This rank's place for its records: keyword arguments of ``StepCollector.for_rank`` (tp/pp/dp_rank)."""

    def resume(self, source: Path) -> int:
        """Load the checkpoint at ``source``; returns the step it holds (the last completed one)."""

    def batch(self, step: int) -> Any:
        """This rank's input of ``step`` (the loop times it as data time)."""

    def step(self, step: int, batch: Any) -> StepResult:
        """Forward, backward and optimizer step of ``step`` on ``batch``."""

    def save(self, step: int) -> Path:
        """Write a complete checkpoint of ``step`` under ``ctx.checkpoint_dir``; returns its folder."""

    def close(self) -> None:
        """Release what the engine holds (called once, also after an error)."""


def run(ctx: "RankContext", build: Callable[["RankContext"], Engine]) -> None:
    """A backend's ``run(ctx)``: join the process group on this rank's device, build the engine, ``train`` it;
    rank 0 logs the start-up phases (imports, process group, model build; ``train`` the rest) as they end."""
    from hpc_tools.runtime.progress import StartupLog, process_age_s

    startup = StartupLog(ctx.info)
    age = process_age_s()
    if age is not None:
        startup.done("imports", age, "interpreter, packages and the recipe, since the process started")
    t0 = time.perf_counter()
    with process_group(ctx):
        startup.done("process group", time.perf_counter() - t0, ctx.dist_backend)
        t0 = time.perf_counter()
        engine = build(ctx)
        startup.done("model build", time.perf_counter() - t0)
        train(ctx, engine, startup=startup)


@contextlib.contextmanager
def process_group(ctx: "RankContext") -> Iterator[None]:
    """torch.distributed over ``ctx.dist_backend`` (gloo on CPU, nccl on GPU) for the duration.

    A group that already exists (a harness running many jobs in one process group) is used and left up; the groups
    the job created beside it are destroyed at the end (``train/groups.py``). On success
    the ranks leave together (a barrier); after an error this rank leaves at once, so that its peers fail fast
    instead of waiting for it.
    """
    import torch
    import torch.distributed as dist

    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    from hpc_tools.train import groups

    created = not dist.is_initialized()
    if created:
        dist.init_process_group(ctx.dist_backend, rank=ctx.rank, world_size=ctx.dist.world_size,
                                timeout=getattr(ctx, "collective_timeout", None))  # the hang watchdog fires first
    before = None if created else groups.snapshot()
    try:
        yield
        dist.barrier()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
        elif before is not None and dist.is_initialized():
            groups.destroy_since(before)  # the job's own groups: the harness's next job makes its own


def default_collector(ctx: "RankContext", **coords: int):
    """The records of this rank: ``profiling.collector.StepCollector`` configured from the recipe."""
    from profiling.collector import StepCollector

    return StepCollector.for_rank(ctx, **coords)


def resume(ctx: "RankContext", engine: Engine) -> int:
    """Load the checkpoint the recipe asks for into ``engine``; the last completed step (0 for a fresh start).

    Collective. Each candidate (``resume_source``, newest first) is verified by every rank's share and then loaded;
    one that fails verification is set aside when it is the run's own (renamed ``iter_N.bad-<reason>``, never
    deleted); one that fails to load after its files verified (an out-of-memory, a library mismatch: not the files'
    fault) or came from ``checkpoint.load_path`` is skipped, left as it is; each is logged with the file and the
    reason, and the next older one is tried. None left after a failure: ``CheckpointError`` naming the file(s)."""
    from hpc_tools.train import checkpoint_agree

    if not engine.checkpoints:
        return 0
    from hpc_tools.train import node_tier
    from hpc_tools.train.saving import tiers

    ck = ctx.recipe.checkpoint
    dirs, local = tiers(ctx)  # the shared tier, and this node's folder of the node-local one when in use
    nodes = node_tier.Nodes.of(ctx) if local is not None and ck.resume else None
    if ck.resume:
        for tier in (dirs, local) if local is not None else (dirs,):
            for path, why in tier.incomplete():
                ctx.info("checkpoint %s is not complete, not resumed from: %s", path, why)
    skip: list[Path] = []
    failures: list[str] = []
    while True:
        # the local tier: the newest checkpoint the nodes hold together (collective), copied to every node when it
        # is newer than the shared tier's (on a tie the shared, durable one)
        cand = node_tier.candidate(local, nodes, skip) if nodes is not None else None
        source = resume_source(dirs, resume=ck.resume, load_path=None if cand else ck.load_path, skip=skip)
        share = None
        own = source is not None and source.parent == dirs.root
        if cand is not None and (not own or cand.step > parse_step(source.name)):
            source, share = node_tier.assemble(local, nodes, cand), nodes.share
        if source is None:
            if failures:
                raise CheckpointError("no checkpoint left to resume from: " + "; ".join(failures)
                                      + " (set aside: the folders named *.bad-*; fix or remove them, or fix the "
                                        "load error, to retry)")
            return 0
        step, problem = _verified_load(ctx, engine, source, checksum=ck.verify == "checksum", share=share)
        tier, leads = (local, nodes.is_leader) if share else (dirs if own else None, ctx.is_rank0)
        if problem is None:
            if leads and tier is not None:
                tier.mark_verified(source)  # kept by keep_last until a later resume verifies a newer one
            return step
        failures.append(problem.line(source))
        skip.append(source)
        verified = problem.reason == "load"  # its files passed verification: kept, only skipped
        moved = tier.set_aside(source, problem.reason, problem.line(source)) \
            if leads and tier is not None and not verified else None
        if ctx.is_rank0:
            log.error("checkpoint %s is bad: %s; %s; falling back to the previous complete checkpoint", source,
                      problem.line(source), f"set aside as {moved.name}" if moved else
                      "skipped, kept (its files verified)" if verified else "skipped (checkpoint.load_path)")
        checkpoint_agree.gather(None)  # the others wait for the rename before listing the folder again


def _verified_load(ctx: "RankContext", engine: Engine, source: Path, *, checksum: bool,
                   share: tuple[int, int] | None = None):
    """Collective: (step, None) once ``source`` verified and loaded on every rank, else (None, the first problem).
    ``share``: this rank's part among the ranks that see the same copy (``checkpoint_agree.agree``)."""
    from hpc_tools.checkpoints.verify import Problem
    from hpc_tools.train import checkpoint_agree

    meta = CheckpointDirs.read_meta(source)
    problems, cost = checkpoint_agree.agree(source, meta, checksum=checksum, share=share)
    if problems:
        for p in problems[1:]:
            ctx.info("  also: %s", p.line(source))
        return None, problems[0]
    t0 = time.perf_counter()
    step, error = None, None
    try:
        step = engine.resume(source)
    except UserError:
        raise  # a checkpoint of the wrong kind for this recipe: the user's to fix, not a corrupt one
    except Exception as e:  # noqa: BLE001 - any failure to load falls back, with its type and text
        error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
    load_s = time.perf_counter() - t0
    errors = [(r, e) for r, e in enumerate(checkpoint_agree.gather(error)) if e]
    if errors:
        rank, text = errors[0]
        return None, Problem(".", "load", f"failed to load on rank {rank}: {text}")
    verify_s = cost["seconds"]
    ctx.info("checkpoint verified: %d files in %.2f s (%s; %.3f GB checksummed, %.2f GB/s per rank), loaded in "
             "%.2f s: verification = %.0f%% of verify+load", cost["files"], verify_s,
             "sizes and checksums" if cost["checksums"] else "sizes only", cost["bytes"] / 1e9,
             cost["gb_per_s_per_rank"], load_s, 100.0 * verify_s / max(verify_s + load_s, 1e-9))
    ctx.info("resumed from %s at step %d", source, step)
    return step, None


def _nonfinite(ctx: "RankContext", step: int, result: StepResult, in_row: int, limit: int) -> None:
    """Log a non-finite step (rank 0); past ``limit`` in a row raise ``NonFiniteError`` on every rank."""
    what = f"loss={result.loss}, grad_norm={result.grad_norm}"
    if in_row > limit:
        raise NonFiniteError(f"step {step}: loss or gradient norm not finite ({what}) for {in_row} step(s) in a row, "
                             f"steps {step - in_row + 1}..{step} (training.max_nonfinite_steps={limit}); stopped "
                             "without saving: the newest checkpoint is the last good one (lower training.lr, raise "
                             "training.max_nonfinite_steps, or check the data of these steps)")
    if ctx.is_rank0:
        log.warning("step %d: loss or gradient norm not finite (%s): update skipped, %d in a row "
                    "(training.max_nonfinite_steps=%d)", step, what, in_row, limit)


def report_event(collector, kind: str, t0: float, step: int) -> None:
    """Tell the collector that ``kind`` (a checkpoint save or load) of ``step`` took since ``perf_counter`` ``t0``
    (``profiling.collector.StepCollector.event``; goodput reads it); a collector without events is left alone."""
    event = getattr(collector, "event", None)
    if event is not None:
        event(kind, time.perf_counter() - t0, step=step)


def _save_cost(ctx: "RankContext", path: Path, seconds: float) -> str:
    """`` in S s (file lists R s = P%)`` for rank 0's save line, from the meta file the save committed."""
    if not ctx.is_rank0:
        return ""
    try:
        record_s = float(CheckpointDirs.read_meta(path)["files"]["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    share = 100 * record_s / max(seconds, 1e-9)
    return f" in {seconds:.2f} s (file lists and checksums {record_s:.2f} s = {share:.1f}%)"


def save_due(step: int, last: int, interval: int | None, stop: bool) -> bool:
    """Whether step ``step`` ends with a checkpoint: on a stop, at the last step, and every ``interval`` steps."""
    return stop or step == last or bool(interval and step % interval == 0)


def eval_due(step: int, last: int, interval: int | None) -> bool:
    """Whether step ``step`` is followed by an evaluation: every ``training.eval_interval`` steps and at the last."""
    return bool(interval) and (step % interval == 0 or step == last)


class Evaluation:
    """The validation loss of an engine that has ``evaluate``: ``training.eval_iters`` global batches of the
    validation samples (``hpc_tools.train.data.validation_samples``), the same batches at every evaluation (so that
    evaluations compare), each rank its data-parallel share, as a training step takes its own."""

    def __init__(self, ctx: "RankContext", engine: Engine):
        self.ctx, self.engine = ctx, engine
        self._samples, self._batches = None, None

    @staticmethod
    def wanted(ctx: "RankContext", engine: Engine) -> bool:
        return bool(getattr(ctx.recipe.training, "eval_interval", None)) and hasattr(engine, "evaluate")

    def batches(self) -> list:
        """``eval_iters`` lists of this rank's microbatches (built once, kept: a few global batches)."""
        if self._batches is None:
            from hpc_tools.train import data

            samples = data.validation_samples(self.ctx.recipe)
            if samples is None:
                self._batches = []
            else:
                dp_rank = self.engine.coords().get("dp_rank", 0)
                self._batches = [data.microbatches_for_step(samples, i, dp_rank, self.ctx.layout)
                                 for i in range(1, self.ctx.recipe.training.eval_iters + 1)]
        return self._batches

    def __call__(self) -> tuple[float | None, float]:
        """(mean validation loss, the same on every rank, or None without validation data; wall seconds)."""
        t0 = time.perf_counter()
        batches = self.batches()
        loss = self.engine.evaluate(batches) if batches else None
        return loss, time.perf_counter() - t0


def _open_trackers(ctx: "RankContext"):
    """``hpc_tools.tracking.open_trackers`` on rank 0 (None elsewhere, or when tracking is unavailable: it never
    stops training)."""
    if not ctx.is_rank0:
        return None
    try:
        from hpc_tools.tracking import open_trackers

        return open_trackers(ctx.run_dir, ctx.recipe)
    except ImportError:
        return None  # hpc_tools.tracking not installed: no trackers
    except Exception as e:  # noqa: BLE001 - an experiment tracker must never stop training
        log.warning("experiment tracking off: %s: %s", type(e).__name__, str(e).splitlines()[0][:200] if str(e)
                    else "")
        return None


def train(ctx: "RankContext", engine: Engine, collector_for: Callable[..., Any] = default_collector,
          startup=None) -> None:
    """Steps ``resume+1 .. training.train_iters`` of ``engine`` with records, heartbeats, the stop agreement,
    evaluations, progress lines and the saves (see the module docstring); closes the trackers, the collector, then
    the engine, whatever happens."""
    from hpc_tools.runtime.progress import ProgressMeter, StartupLog

    startup = startup if startup is not None else StartupLog(ctx.info)
    collector = trackers = saver = None
    ok = False
    try:
        t_load = time.perf_counter()  # checkpoint verify + load, reported to the collector's events for goodput
        first = resume(ctx, engine) + 1
        load_s = time.perf_counter() - t_load
        startup.done("checkpoint load", load_s, f"resumed at step {first - 1}" if first > 1 else "fresh start")
        training, interval = ctx.recipe.training, ctx.recipe.checkpoint.interval_iters
        last = training.train_iters
        limit = getattr(training, "max_nonfinite_steps", 0)
        eval_interval = getattr(training, "eval_interval", None)
        ctx.info("%s; steps %d..%d", engine.describe(), first, last)
        collector = collector_for(ctx, **engine.coords())
        if first > 1:
            report_event(collector, "checkpoint_load", t_load, first - 1)
        evaluation = Evaluation(ctx, engine) if Evaluation.wanted(ctx, engine) else None
        meter = ProgressMeter(first=first, total=last, eval_interval=eval_interval) if ctx.is_rank0 else None
        trackers = _open_trackers(ctx)
        if engine.checkpoints and hasattr(engine, "write_checkpoint"):
            from hpc_tools.train.saving import Saver

            saver = Saver(ctx, engine)  # tiers and background writes, the same for every backend
        in_row = 0
        for step in range(first, last + 1):
            t_step = time.perf_counter()
            collector.start_step(step)
            with collector.data_timer():
                batch = engine.batch(step)
            result = engine.step(step, batch)
            record = collector.end_step(step, loss=result.loss, lr=result.lr, grad_norm=result.grad_norm,
                                        skipped=result.skipped, nonfinite=result.nonfinite,
                                        **({"figures": result.figures} if result.figures else {}))
            if step == first:
                startup.done("first step", time.perf_counter() - t_step)
            ctx.heartbeat(step)
            in_row = in_row + 1 if result.nonfinite else 0
            if in_row:
                _nonfinite(ctx, step, result, in_row, limit)
            if meter is not None:
                meter.add(record if isinstance(record, dict) else None, step, result.loss)
            evaluated = evaluation is not None and eval_due(step, last, eval_interval)
            if evaluated:  # after the step's time was taken: evaluation is its own goodput bucket
                val_loss, eval_s = evaluation()
                getattr(collector, "add_evaluation", lambda *a: None)(step, val_loss, eval_s)
                if meter is not None and val_loss is not None:
                    meter.add_eval(step, val_loss, eval_s)
            if step % training.log_interval == 0 or step == last or evaluated:
                if result.note:
                    ctx.info("%s", result.note)
                if meter is not None:
                    _progress(ctx, meter, step, last, trackers)
            stop = ctx.agree_stop(final=step == last)
            if saver is not None:
                _saves(ctx, collector, saver, step, last, stop, in_row)
            elif engine.checkpoints and save_due(step, last, interval, stop):
                if in_row:
                    ctx.info("checkpoint of step %d not saved: the step was not finite (the newest checkpoint "
                             "stays the last good one)", step)
                else:
                    getattr(collector, "flush", lambda: None)()  # the checkpoint's steps are on disk before it
                    t_save = time.perf_counter()
                    path = engine.save(step)
                    ctx.info("checkpoint saved: %s%s", path, _save_cost(ctx, path, time.perf_counter() - t_save))
                    report_event(collector, "checkpoint_save", t_save, step)
            if stop:
                ok = True
                ctx.finish_preempted(step)
                return
        if first > last:
            ctx.info("nothing to do: the checkpoint is at step %d and training.train_iters=%d", first - 1, last)
        if saver is not None:
            for rec in saver.drain():  # nothing is pending after the last save; kept for a run that saved nothing
                _report_save(ctx, collector, rec)
        ok = True
    finally:
        if saver is not None and not ok:
            saver.close()
        try:
            if trackers is not None:
                with contextlib.suppress(Exception):  # never raises into training, nor out of its end
                    trackers.close()
            if collector is not None:
                collector.close()
        finally:
            engine.close()


def _saves(ctx: "RankContext", collector, saver, step: int, last: int, stop: bool, in_row: int) -> None:
    """Collective, every step boundary: commit a finished background write (``Saver.poll``), then save step ``step``
    when a tier is due (shared: a stop, the last step, every checkpoint.interval_iters; local: every
    checkpoint.local_interval_iters), never after a non-finite step; each save's record becomes a ``checkpoint_save``
    event (its seconds = the time training was blocked)."""
    records = saver.poll()
    tier = saver.tier_due(step, last, stop)
    if tier is not None and in_row:
        ctx.info("checkpoint of step %d not saved: the step was not finite (the newest checkpoint stays the last "
                 "good one)", step)
        if stop or step == last:
            records += saver.drain()
    elif tier is not None:
        getattr(collector, "flush", lambda: None)()  # the checkpoint's steps are on disk before it
        records += saver.save(step, tier, final=stop or step == last)
    for rec in records:
        _report_save(ctx, collector, rec)


def _report_save(ctx: "RankContext", collector, rec) -> None:
    """Rank 0's line for a save that ended, and the collector's ``checkpoint_save`` event with its record."""
    if rec.verified and not rec.async_:
        ctx.info("checkpoint saved: %s%s", rec.path, _save_cost(ctx, Path(rec.path), rec.write_s))
    elif rec.verified:
        ctx.info("checkpoint of step %d: blocked training %.3f s of a %.2f s background write (%s tier)",
                 rec.iteration, rec.blocked_s, rec.write_s, rec.tier)
    event = getattr(collector, "event", None)
    if event is not None:
        fields = rec.as_dict()
        fields.pop("iteration")
        event("checkpoint_save", rec.blocked_s, step=rec.iteration, **fields)


def _progress(ctx: "RankContext", meter, step: int, last: int, trackers) -> None:
    """Rank 0's progress line of ``step``, its ``progress.json`` for ``status``, and the trackers' scalars."""
    from hpc_tools.runtime.progress import write_progress

    line, scalars = meter.line(step)
    ctx.info("%s", line)
    run_dir = getattr(ctx, "run_dir", None)
    if run_dir is not None:
        val = (meter.val_step, meter.val_loss) if meter.val_step is not None else None
        write_progress(run_dir, step, last, line, scalars, meter.eta_s(step), val)
    if trackers is not None:
        with contextlib.suppress(Exception):
            trackers.log(step, scalars)
