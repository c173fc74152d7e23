"""Health while training: preflight's checks repeated cheaply every ``profiling.health_interval_min`` minutes
between two steps (docs/preflight.md, "Health while training"), so that a node that degrades mid-run (a throttled GPU,
a host whose CPU another job took) is named while the run goes on, not found later as a slower job.

One check, on every rank at the same step (the loop calls ``Health.after_step`` after each step):

1. a short GEMM at the training precision (``preflight.measure.gemm_tflops``; CPU ranks of one machine take turns,
   as in preflight, since they share its cores) and one all-reduce over all ranks at a small size
   (``preflight.measure.collective_seconds``);
2. every rank's figures gathered, judged by preflight's own ``verdict.judge`` (a node's GEMM against the node median,
   or the other node of two, and the hardware peak), the same answer on every rank; a check that finds a node slow
   measures the GEMM once more at once and keeps the best of both looks (as preflight's ``SECOND_LOOKS``);
3. ``health_verdict.Tracker``: a node found slow by ``CONFIRM`` checks in a row is named: rank 0 records it in
   ``health.json``, the manifest's ``health`` and an event (``status`` and the report read them); when a spare, fewer
   nodes or a requeue can replace it (``preflight.leave_out.replacement``, from the hints the restart controller
   exported: ``cluster.restarts`` > 0), rank 0 writes preflight's leave-out marker (``source: health``) and the
   manifest's ``health leave-out`` event before any rank can end the step (srun's ``--kill-on-bad-exit`` may stop
   rank 0 as soon as a peer ends it), and the loop saves the step's checkpoint and ends the step with preflight's
   exit code, so the controller starts the next step without the node exactly as after preflight
   (``job/restarts/named_nodes.py``); else the run trains on (one line: stopping mid-run would lose the steps since
   the last checkpoint).

``cluster.preflight: off`` turns the checks off with preflight, and so does a job preflight skips (``auto`` on one
node). The check's time is outside every step's record (taken after ``end_step``) and is an event
(``health_check``) of rank 0's events file; its share of the run is in ``health.json`` and ``status``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from hpc_tools.runtime import health_verdict as hv
from hpc_tools.runtime.preflight import leave_out, measure
from hpc_tools.runtime.preflight import run as preflight
from hpc_tools.runtime.preflight.verdict import RankResult, busbw_gbps, judge

if TYPE_CHECKING:
    from hpc_tools.runtime.context import RankContext

log = logging.getLogger("hpc_tools")
GEMM_N = {"cpu": 768, "cuda": 4096}
"""The check's GEMM: on GPU a quarter of preflight's side (a 4096^3 product still runs near the peak, and its three
matrices take 100 MB at bf16 beside the training's memory, not 400); on CPU three times preflight's, so that one
product (about 10 ms at fp32) outlasts a CPU quota's burst (1 ms every 5 ms at 0.2 CPU) instead of fitting in it."""
GEMM_SLICE_S = {"cpu": 0.05, "cuda": 0.05}
GEMM_MAX_ITERS = 20
ALL_REDUCE_ITERS = 4


class HealthLeaveOut(leave_out.LeaveOut):
    """Every rank, after the checkpoint of the step: the nodes the health check named can be left out."""

    event = "health leave-out"


class Health:
    """This start's checks on this rank; ``for_run`` makes it (None when off)."""

    def __init__(self, ctx: "RankContext", first: int, collector=None):
        prof = ctx.recipe.profiling
        self.ctx, self.collector = ctx, collector
        self.interval_s = float(prof.health_interval_min) * 60
        self.next = hv.first_step(first, int(prof.warmup_steps))
        self.tracker = hv.Tracker()
        self.record = hv.Record(start=ctx.dist.restart_count, interval_min=float(prof.health_interval_min),
                                started=time.time())
        self.mark = (time.perf_counter(), first - 1)  # (clock, step) after the previous check
        self.turn_of: dict[int, int] | None = None
        self.baseline: float | None = None
        self.nbytes = preflight.SIZE_BOUNDS[ctx.device.type][0]
        self.node = preflight.node_label(ctx)
        # CPU ranks multiply in fp32: a bf16 product is emulated there (20x slower), and on CPU only the nodes'
        # figures against each other count (no hardware peak)
        self.precision = ctx.recipe.training.precision if ctx.device.type == "cuda" else "fp32"
        self.leaving: str | None = None

    @classmethod
    def for_run(cls, ctx: "RankContext", first: int, collector=None) -> "Health | None":
        """The checks when ``profiling.health_interval_min`` > 0, ``cluster.preflight`` is not off and the job has
        two ranks or more (``auto`` on one node too, unlike preflight: a GPU that slows mid-run is judged against the
        hardware peak; a first check that finds nothing to judge by, one node without a peak, turns them off);
        else None."""
        # a harness's stand-in recipe may have no profiling section: no checks
        interval = getattr(getattr(ctx.recipe, "profiling", None), "health_interval_min", 0) or 0
        if interval <= 0 or ctx.dist.world_size < 2 or ctx.recipe.cluster.preflight == "off":
            return None
        if ctx.device.type != "cuda" and ctx.dist.executor == "local":
            per = int(os.environ.get(preflight.RANKS_PER_NODE_ENV) or ctx.layout.ranks_per_node or 1)
            if ctx.dist.world_size // max(per, 1) < 2:
                return None  # CPU ranks standing for one node: nothing to compare, known without a check
        return cls(ctx, first, collector)

    def after_step(self, step: int) -> bool:
        """After step ``step`` on every rank: a check when one is due (collective); True when the nodes it named are
        to be left out now (the same on every rank)."""
        if step < self.next:
            return False
        return self._check(step)

    def leave(self, step: int) -> None:
        """After the checkpoint of ``step`` (the check's step): end the step for the restart controller."""
        raise HealthLeaveOut(self.leaving)

    # -- one check -----------------------------------------------------------------------------------------------
    def _check(self, step: int) -> bool:
        import torch.distributed as dist

        ctx = self.ctx
        t0 = time.perf_counter()
        rate = (t0 - self.mark[0]) / max(step - self.mark[1], 1)
        mine = RankResult(rank=ctx.rank, node=self.node)
        self._gemm(mine)
        secs = measure.collective_seconds("all_reduce", self.nbytes, None, ctx.dist.world_size, ctx.device,
                                          ctx.rank, iters=ALL_REDUCE_ITERS)
        peak = preflight._peak(ctx.recipe)
        gathered, rows = self._judged(mine, rate, secs, peak)
        looks = 1
        if hv.slow_nodes(rows):  # a second look at once, the best of both kept (as preflight's SECOND_LOOKS)
            self._gemm(mine)
            gathered, rows = self._judged(mine, rate, secs, peak)
            looks = 2
        busbw = busbw_gbps("all_reduce", self.nbytes, max(g[2] for g in gathered), ctx.dist.world_size)
        self.baseline = self.baseline if self.baseline is not None else busbw
        number = len(self.record.checks) + 1
        new = self.tracker.add(number, hv.slow_nodes(rows))
        how = self._way(new)
        seconds = time.perf_counter() - t0
        check = {"check": number, "step": step, "time": round(time.time(), 3), "seconds": round(seconds, 4),
                 "looks": looks, "busbw_gbps": busbw, "problem": hv.link_problem(busbw, self.baseline, self.nbytes),
                 "nodes": {r.node: {"gemm_tflops": r.gemm_tflops, "verdict": r.verdict, "reasons": r.reasons}
                           for r in rows}}
        self.record.add(check)
        line = named_line(check, rows, new) if new else ""
        if how:  # every rank's own words for the step's end (rank 0 also writes the marker and records the event)
            self.leaving = (f"{line}; leaving {', '.join(new)} out of the run: {how} "
                            f"(after the checkpoint of step {step})")
        if ctx.is_rank0:
            self._tell(check, rows, new, how, line)
        if self.collector is not None:
            self.collector.event("health_check", seconds, step=step)
        self.next = hv.next_step(step, self.interval_s, [g[1] for g in gathered])
        if len(rows) < 2 and not peak:  # one node, no hardware peak (CPU ranks): nothing to judge a node by
            self.next = float("inf")
            ctx.info("health checks off after the first: one node and no hardware peak, nothing to compare it with")
        self.mark = (time.perf_counter(), step)
        if not how:
            return False
        if dist.is_initialized():
            dist.barrier()  # the marker is written before any rank ends the step
        return True

    def _judged(self, mine: RankResult, rate: float, secs: float, peak: float | None) -> tuple[list, list]:
        """Every rank's (result, seconds per step, all-reduce seconds) and preflight's verdict on them, the same on
        every rank."""
        import torch.distributed as dist

        gathered: list = [None] * self.ctx.dist.world_size
        dist.all_gather_object(gathered, (mine, rate, secs))
        return gathered, judge([g[0] for g in gathered], peak_tflops=peak)

    def _gemm(self, mine: RankResult) -> None:
        """This rank's GEMM figure; CPU ranks of one machine in turns (they share its cores). Its random matrices come
        from a forked generator, so a run with checks draws the same dropout and data as one without."""
        import torch
        import torch.distributed as dist

        ctx, dev = self.ctx, self.ctx.device.type
        if self.turn_of is None:
            places: list = [None] * ctx.dist.world_size
            dist.all_gather_object(places, (ctx.rank, preflight.machine_id()))
            self.turn_of = {r: [p[0] for p in places if p[1] == m].index(r) for r, m in places}
        turns = 1 if dev == "cuda" else max(self.turn_of.values()) + 1
        with torch.random.fork_rng(devices=[ctx.device] if dev == "cuda" else []):  # the run's RNG streams untouched
            self._turns(mine, turns)

    def _turns(self, mine: RankResult, turns: int) -> None:
        import torch.distributed as dist

        ctx, dev = self.ctx, self.ctx.device.type
        for t in range(turns):
            if turns == 1 or self.turn_of[ctx.rank] == t:
                try:
                    g = measure.gemm_tflops(ctx.device, self.precision, GEMM_N[dev], GEMM_SLICE_S[dev], ctx.rank,
                                            max_iters=GEMM_MAX_ITERS)
                    mine.gemm_tflops = max(g, mine.gemm_tflops or 0.0)  # a second look keeps the best
                except Exception as exc:  # noqa: BLE001 - a broken device is a finding, named in the table
                    mine.error = f"{type(exc).__name__}: {exc}"
            if turns > 1:
                dist.barrier()

    def _way(self, new: list[str]) -> str | None:
        """How the newly named nodes can be left out (the same on every rank: the hints are the step's), or None."""
        if not new or os.environ.get("HPC_TOOLS_EXECUTOR") == "local":
            return None  # the local executor's ranks stand in for nodes: nothing replaces them
        return leave_out.replacement(new, os.environ)

    def _tell(self, check: dict, rows, new: list[str], how: str | None, line: str) -> None:
        """Rank 0: the named nodes (log line, manifest, marker when they can be left out) and ``health.json``."""
        ctx, record = self.ctx, self.record
        now = time.time()
        if new:
            action = f"left out: {how}" if how else "nothing can replace it: training goes on"
            for r in rows:
                if r.node in new:
                    record.name(r.node, r, check, action)
            if how:
                about = {n: record.named[n] for n in new}
                leave_out.write(ctx.run_dir, ctx.dist.restart_count, new, ctx.recipe.cluster.preflight, line, how,
                                about, source="health")
            log.warning("%s; %s", line, action)
        elif check["problem"]:
            log.warning("health check %d at step %d: %s", check["check"], check["step"], check["problem"])
        record.write(ctx.run_dir, now)
        summary = record.summary(now)
        before = (ctx.run.manifest().get("health") or {}).get("named_all")
        summary["named_all"] = hv.merged_named(before, summary["named"])
        ctx.run.update(event="health named" if new else None, soft=True, health=summary)
        if how:  # recorded now, before the barrier: once a peer ends the step, srun may stop rank 0 at once
            ctx.run.update(event=HealthLeaveOut.event, reason=self.leaving, soft=True)


def named_line(check: dict, rows, new: list[str]) -> str:
    """"health check 5 at step 93 (found slow in 2 checks in a row): node n2 slow: GEMM ...": the newly named nodes
    with their verdicts and reasons."""
    words = "; ".join(f"node {r.node} {r.verdict}: {'; '.join(r.reasons)}" for r in rows if r.node in new)
    return (f"health check {check['check']} at step {check['step']} (found slow in {hv.CONFIRM} checks in a row): "
            f"{words}")
