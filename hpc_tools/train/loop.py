"""The one training loop every backend runs (Megatron, DeepSpeed, FSDP, comm_check), driving the ``RankJob`` and
``Collector`` protocols of ``hpc_tools.train.engine``.

What the loop owns, in this order for each step ``s`` of ``start+1 .. training.train_iters``::

    collector.start_step(s); batch = engine.batch(s) (timed as data time); result = engine.step(s, batch)
    collector.end_step(s, ...); ctx.heartbeat(s)
    if result.nonfinite: count it; past training.max_nonfinite_steps in a row raise NonFiniteError naming the step
    every training.eval_interval steps and at the last: val_loss = engine.evaluate(validation batches) (collective,
        after the step's time was taken; its loss and wall time join step s's record: ``val_loss``, ``eval_time_s``)
    at training.log_interval, the last step and evaluations: rank 0 logs the progress line (``progress.py``),
        writes ``progress.json`` and hands the scalars to the experiment trackers (``hpc_tools.tracking``)
    every profiling.health_interval_min: leave = health.after_step(s)   # runtime/health.py; collective when due
    stop = leave or ctx.agree_stop()                 # collective: every rank takes the same branch below
    saver.save(s, last, stop=stop, nonfinite=...)    # the saver decides whether s saves, and to which tier
    if stop: ctx.finish_preempted(s) and return      # the checkpoint of step s exists before the requeue
             (leave: health.leave(s) ends the step, so the restart controller leaves the named nodes out)

Rank 0 also logs the start-up phases (imports, process group, model build, checkpoint load, first step) once each.

Before the first step the run continues from the checkpoint ``checkpointing.resume.resume`` verified and loaded
(steps are 1-based and continue across resumes; records are appended); the saves are
``checkpointing.saver.Saver``'s (when, where, background writes, the commit). Whatever happens, the collector is
closed and then the engine, in a ``finally``. ``run`` adds the process group around it all.

Non-finite steps: every engine decides ``StepResult.nonfinite`` the same way on every rank (an all-reduced flag) and
skips the update of such a step itself (before its optimizer step); the loop counts them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Callable, Iterator

from hpc_tools.runtime.health import Health
from hpc_tools.train.checkpointing.resume import resume
from hpc_tools.train.checkpointing.saver import Saver
from hpc_tools.train.engine import Collector, RankJob, StepResult

if TYPE_CHECKING:
    from hpc_tools.runtime.context import RankContext

log = logging.getLogger("hpc_tools")

INJECT_NONFINITE_ENV = "HPC_TOOLS_INJECT_NONFINITE"
"""Fault injection for tests only: ``"6,7"`` or ``"6,7@1"`` makes the engines poison the loss (and so the gradients)
of those steps, on every rank or only on rank 1."""


class NonFiniteError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm (training.max_nonfinite_steps)."""


def nonfinite_injected(step: int, rank: int) -> bool:
    """Whether the test hook ``HPC_TOOLS_INJECT_NONFINITE`` asks to poison ``step`` on ``rank``."""
    spec = os.environ.get(INJECT_NONFINITE_ENV, "").strip()
    if not spec:
        return False
    steps, _, on = spec.partition("@")
    return str(step) in steps.split(",") and (not on or int(on) == rank)


def run(ctx: "RankContext", build: Callable[["RankContext"], RankJob]) -> None:
    """A backend's ``run(ctx)``: join the process group on this rank's device, build the engine, ``train`` it;
    rank 0 logs the start-up phases (imports, process group, model build; ``train`` the rest) as they end."""
    from hpc_tools.runtime.progress import StartupLog, process_age_s
    from hpc_tools.train import dynamo_lazy

    dynamo_lazy.install()  # before any optimizer or DTensor: TorchDynamo only if something compiles
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
        from hpc_tools.runtime.distenv import join_world

        join_world(ctx.dist_backend, ctx.dist, getattr(ctx, "collective_timeout", None))  # the watchdog fires first
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


def eval_due(step: int, last: int, interval: int | None) -> bool:
    """Whether step ``step`` is followed by an evaluation: every ``training.eval_interval`` steps and at the last."""
    return bool(interval) and (step % interval == 0 or step == last)


class Evaluation:
    """The validation loss of the engine (``RankJob.evaluate``): ``training.eval_iters`` global batches of the
    validation samples (``hpc_tools.train.data.validation_samples``), the same batches at every evaluation (so that
    evaluations compare), each rank its data-parallel share, as a training step takes its own."""

    def __init__(self, ctx: "RankContext", engine: RankJob):
        self.ctx, self.engine = ctx, engine
        self._samples, self._batches = None, None

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
        dog = getattr(self.ctx, "watchdog", None)  # an evaluation is its own hang phase, never part of a step's
        with dog.outside_step("evaluation") if dog is not None else contextlib.nullcontext():
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


def train(ctx: "RankContext", engine: RankJob, collector_for: Callable[..., Collector] = default_collector,
          startup=None) -> None:
    """Steps ``resume+1 .. training.train_iters`` of ``engine`` with records, heartbeats, the stop agreement,
    evaluations, progress lines and the saves (see the module docstring); closes the trackers, the collector, then
    the engine, whatever happens."""
    from hpc_tools.runtime.progress import StartupLog

    startup = startup if startup is not None else StartupLog(ctx.info)
    collector = steps = saver = None
    ok = False
    try:
        t_load = time.perf_counter()  # checkpoint verify + load, reported to the collector's events for goodput
        first = resume(ctx, engine) + 1
        startup.done("checkpoint load", time.perf_counter() - t_load,
                     f"resumed at step {first - 1}" if first > 1 else "fresh start")
        ctx.note_layout(first - 1)
        last = ctx.recipe.training.train_iters
        ctx.info("%s; steps %d..%d", engine.describe(), first, last)
        collector = collector_for(ctx, **engine.coords())
        if first > 1:
            collector.event("checkpoint_load", time.perf_counter() - t_load, step=first - 1)
        steps = _Steps(ctx, engine, collector, first, last)
        if engine.checkpoints:
            saver = Saver(ctx, engine, collector)  # when to save, tiers, background writes, the commit
        health = Health.for_run(ctx, first, collector)  # preflight's checks every few minutes (None: off)
        for step in range(first, last + 1):
            result = steps.run(step, startup)
            leave = health is not None and health.after_step(step)  # collective when due; one answer on every rank
            stop = leave or ctx.agree_stop(final=step == last)
            if saver is not None:
                saver.save(step, last, stop=stop, nonfinite=result.nonfinite)
            if stop:
                ok = True
                health.leave(step) if leave else ctx.finish_preempted(step)  # leave: the step ends for the controller
                return
        if first > last:
            ctx.info("nothing to do: the checkpoint is at step %d and training.train_iters=%d", first - 1, last)
        if saver is not None:
            saver.finish()
        ok = True
    finally:
        if saver is not None and not ok:
            saver.close()
        try:
            if steps is not None:
                steps.close_trackers()
            if collector is not None:
                collector.close()
        finally:
            engine.close()


class _Steps:
    """One step of ``train`` after another: the records, the data time, the non-finite count, evaluations and rank
    0's progress lines, ``progress.json`` and trackers."""

    def __init__(self, ctx: "RankContext", engine: RankJob, collector: Collector, first: int, last: int):
        from hpc_tools.runtime.progress import ProgressMeter

        training = ctx.recipe.training
        self.ctx, self.engine, self.collector, self.first, self.last = ctx, engine, collector, first, last
        self.limit = getattr(training, "max_nonfinite_steps", 0)
        self.eval_interval = getattr(training, "eval_interval", None)
        self.evaluation = Evaluation(ctx, engine) if self.eval_interval else None
        self.meter = ProgressMeter(first=first, total=last, eval_interval=self.eval_interval) if ctx.is_rank0 else None
        self.trackers = _open_trackers(ctx)
        self.in_row = 0

    def run(self, step: int, startup) -> StepResult:
        """Step ``step``: data, the engine's step, its record, the heartbeat; then the evaluation and the progress
        line when due. Raises ``NonFiniteError`` past training.max_nonfinite_steps non-finite steps in a row."""
        ctx, collector, meter = self.ctx, self.collector, self.meter
        t_step = time.perf_counter()
        collector.start_step(step)
        with collector.data_timer():
            batch = self.engine.batch(step)
        result = self.engine.step(step, batch)
        record = collector.end_step(step, loss=result.loss, lr=result.lr, grad_norm=result.grad_norm,
                                    skipped=result.skipped, nonfinite=result.nonfinite,
                                    **({"figures": result.figures} if result.figures else {}))
        if step == self.first:
            startup.done("first step", time.perf_counter() - t_step)
        ctx.heartbeat(step)
        self.in_row = self.in_row + 1 if result.nonfinite else 0
        if self.in_row:
            _nonfinite(ctx, step, result, self.in_row, self.limit)
        if meter is not None:
            meter.add(record if isinstance(record, dict) else None, step, result.loss)
        evaluated = self.evaluation is not None and eval_due(step, self.last, self.eval_interval)
        if evaluated:  # after the step's time was taken: evaluation is its own goodput bucket
            val_loss, eval_s = self.evaluation()
            collector.add_evaluation(step, val_loss, eval_s)
            if meter is not None and val_loss is not None:
                meter.add_eval(step, val_loss, eval_s)
        if step % ctx.recipe.training.log_interval == 0 or step == self.last or evaluated:
            if result.note:
                ctx.info("%s", result.note)
            if meter is not None:
                _progress(ctx, meter, step, self.last, self.trackers)
        return result

    def close_trackers(self) -> None:
        """Never raises into training, nor out of its end."""
        if self.trackers is not None:
            with contextlib.suppress(Exception):
                self.trackers.close()


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
