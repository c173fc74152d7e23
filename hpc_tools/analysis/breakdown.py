"""`analyze RUN --breakdown`: where each traced step went, on every rank, set against the planner term by term.

The buckets of one step on one rank come from its torch.profiler trace (``profiling.breakdown``: the sweep, the
groups); this module joins the run's traces with its step records (the measured step, the ranks' coordinates, the
collectors' pipeline wait) and with the plan of the same recipe, and says where the largest gap is and which rank
the others wait for. The method and its limits: docs/breakdown.md.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from hpc_tools.planner import pipeline_schedule as ps
from hpc_tools.planner import steptime as st
from profiling import breakdown as bd
from profiling import post_save
from profiling.records import iter_rank_columns, read_events
from profiling.schema import fields
from profiling.trace import trace_paths

RECORD_COLUMNS = fields("step", "step_time_s", "tp_rank", "pp_rank", "dp_rank", "pp_wait_s", "data_time_s")
# planner term (hpc_tools.planner.steptime) -> bucket
_TERM_BUCKET = {st.COMPUTE: "compute", st.RECOMPUTE_ELEMENTWISE: "compute", st.BUBBLE: "bubble", st.TP_COMM: "comm.tp",
                st.PP_COMM: "comm.pp", st.DP_COMM: "comm.dp", st.EP_COMM: "comm.ep", st.CP_COMM: "comm.cp",
                st.OFFLOAD: "other"}
FIXES = {
    "compute": "compute slower than planned: check precision, fusions and the attention backend, then calibrate "
               "the planner on this run (plan --calibrate)",
    "comm.tp": "tensor-parallel collectives exposed: keep parallel.tensor_size within a node or lower it",
    "comm.cp": "context-parallel exchange exposed: lower parallel.context_size or lengthen the sequence per rank",
    "comm.ep": "expert all-to-all exposed: lower parallel.expert_size or keep it within a node",
    "comm.dp": "gradient reduction not overlapped (backend.megatron.overlap_grad_reduce and overlap_param_gather; "
               "FSDP/DeepSpeed overlap theirs by design: check the bucket sizes)",
    "comm.pp": "pipeline p2p exposed: fewer stages (parallel.pipeline_size) or a faster link between them",
    "bubble": "pipeline bubble: more microbatches (training.global_batch_size / training.micro_batch_size) or "
              "interleaving (parallel.virtual_pipeline_size)",
    "data": "waiting for input: prepare the data ahead (data.source: indexed) or speed up the loader",
    "host": "host-bound (launch and Python gaps): larger training.micro_batch_size, fewer small operations",
    "checkpoint": "checkpoint saves inside steps: checkpoint.async_save, or a longer checkpoint.interval_iters",
    "other": "time in communication runtime calls or copies outside the collectives: see the trace",
}
WAIT_BUCKETS = {"tp": ("comm.tp",), "pp": ("bubble", "comm.pp"), "dp": ("comm.dp",)}


@dataclass
class RankBreakdown:
    rank: int
    coords: dict[str, int]
    steps: dict[int, dict[str, float]] = field(default_factory=dict)  # traced step -> buckets (s)
    step_time_s: dict[int, float] = field(default_factory=dict)  # the record's, same steps
    pp_wait_s: dict[int, float] = field(default_factory=dict)
    work_s: dict[int, float] = field(default_factory=dict)  # pipelined steps: the stage's own work (pipeline_work_s)
    p2p_s: dict[int, float] = field(default_factory=dict)  # pipelined steps: exposed p2p, every phase (p2p_wait_s)
    saved: dict[int, float] = field(default_factory=dict)  # traced step a save followed -> its blocked time (s)
    checkpoint_per_step: float = 0.0  # the rank's blocked save time over the run, per recorded step

    @property
    def saved_steps(self) -> list[int]:
        return sorted(self.saved)

    def mean(self, bucket: str) -> float:
        """The bucket's mean over the traced steps; ``checkpoint``: the run's blocked save time per step (a sampled
        step that a save followed stands for many steps that none did: its save would count that many times)."""
        if bucket == "checkpoint":
            return self.checkpoint_per_step
        vals = [b.get(bucket, 0.0) for b in self.steps.values()]
        return sum(vals) / len(vals) if vals else 0.0

    def buckets(self) -> dict[str, float]:
        keys = sorted({k for b in self.steps.values() for k in b}, key=_bucket_order)
        return {k: self.mean(k) for k in keys if k in bd.BUCKETS or self.mean(k) > 0}

    def mean_step(self) -> float:
        """Mean of the traced steps' own windows (the sum of their buckets), the saves per step as in ``mean``."""
        if not self.steps:
            return 0.0
        own = sum(sum(b.values()) - self.saved.get(s, 0.0) for s, b in self.steps.items()) / len(self.steps)
        return own + self.checkpoint_per_step

    @property
    def measured_step_s(self) -> float | None:
        """The records' mean over the traced steps, the saves per step as in ``mean`` (so the buckets add up)."""
        vals = [self.step_time_s[s] - self.saved.get(s, 0.0) for s in self.steps if s in self.step_time_s]
        return sum(vals) / len(vals) + self.checkpoint_per_step if vals else None


def _bucket_order(name: str) -> tuple[int, str]:
    return (bd.BUCKETS.index(name), name) if name in bd.BUCKETS else (len(bd.BUCKETS), name)


@dataclass
class Breakdown:
    run_id: str
    ranks: list[RankBreakdown]
    planned: dict[str, float]
    planned_source: str
    bubble_collectors_s: float | None
    verdict: str
    straggler: dict[str, Any] | None
    post_save: dict[str, Any] | None = None  # the steps after each save (profiling.post_save), beside the traced ones

    def to_json(self) -> dict[str, Any]:
        ranks = []
        for r in self.ranks:
            b = r.buckets()
            step = r.measured_step_s
            ranks.append({"rank": r.rank, **r.coords, "step_s": step, "traced_steps": sorted(r.steps),
                          "saved_steps": r.saved_steps,
                          "buckets": b, "sum_s": sum(b.values()),
                          "sum_over_step": sum(b.values()) / step if step else None,
                          "steps": [{"step": s, "step_s": r.step_time_s.get(s), "pp_wait_s": r.pp_wait_s.get(s),
                                     "buckets": r.steps[s]} for s in sorted(r.steps)]})
        mean = mean_buckets(self.ranks)
        return {"run_id": self.run_id, "ranks": ranks, "mean": mean, "planned": self.planned,
                "planned_source": self.planned_source,
                "ratio": {k: (mean.get(k, 0.0) / v if v else None) for k, v in self.planned.items()},
                "bubble_collectors_s": self.bubble_collectors_s, "bubble": bubble_figures(self),
                "straggler": self.straggler, "verdict": self.verdict,
                "post_save": self.post_save}


def mean_buckets(ranks: list[RankBreakdown]) -> dict[str, float]:
    """Each bucket's mean over the ranks (each rank's mean over its traced steps)."""
    keys = sorted({k for r in ranks for k in r.buckets()}, key=_bucket_order)
    return {k: sum(r.mean(k) for r in ranks) / len(ranks) for k in keys} if ranks else {}


def _records(records_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> {"coords", "step_time_s": {step: s}, "pp_wait_s": {step: s}} (a requeued step: its last record)."""
    out = {}
    for rank, cols in iter_rank_columns(records_dir, RECORD_COLUMNS):
        steps = cols.get("step")
        if steps is None or not len(steps):
            continue
        coords = {k: int(cols[k][-1]) for k in ("tp_rank", "pp_rank", "dp_rank") if k in cols}
        row: dict[str, Any] = {"coords": coords, "step_time_s": {}, "pp_wait_s": {}}
        for i, s in enumerate(steps):
            row["step_time_s"][int(s)] = float(cols["step_time_s"][i])
            if "pp_wait_s" in cols and cols["pp_wait_s"][i] == cols["pp_wait_s"][i]:  # not NaN
                row["pp_wait_s"][int(s)] = float(cols["pp_wait_s"][i])
        out[rank] = row
    return out


def measure(run_dir: Path, warmup: int = 0) -> list[RankBreakdown]:
    """Every traced step of every rank (after ``warmup`` steps when later ones were traced), in buckets."""
    records = _records(Path(run_dir) / "records")
    coords = {r: row["coords"] for r, row in records.items()}
    per_step: dict[int, list[tuple[int, Any, dict[str, str], bool]]] = defaultdict(list)
    for path in trace_paths(run_dir):
        trace = bd.read_trace(path)
        rank = bd.trace_rank(trace)
        if rank is None:
            continue
        dims, gpu = bd.group_dims(trace, coords), bd.is_gpu(trace)
        for t in bd.timelines(trace):
            per_step[t.step].append((rank, t, dims, gpu))
    if any(s > warmup for s in per_step):
        per_step = {s: v for s, v in per_step.items() if s > warmup}
    ranks: dict[int, RankBreakdown] = {}
    for step, items in sorted(per_step.items()):
        floor = min((d for _, t, _, _ in items for d in t.p2p_ops), default=None)  # fastest p2p of the step
        # the least time any rank spent in cross-stage collectives after its last backward: theirs without a wait
        tail = min((sum(bd.tail_us(t, dims, gpu).values()) for _, t, dims, gpu in items if t.cuts), default=None)
        for rank, t, dims, gpu in items:
            rec = records.get(rank, {"coords": {}, "step_time_s": {}, "pp_wait_s": {}})
            rb = ranks.setdefault(rank, RankBreakdown(rank, rec["coords"]))
            rb.steps[step] = bd.buckets(t, dims, gpu, p2p_floor_us=floor, tail_floor_us=tail)
            if (work := bd.pipeline_work_s(t, gpu)) is not None:
                rb.work_s[step], rb.p2p_s[step] = work, bd.p2p_wait_s(t, gpu)
            if step in rec["step_time_s"]:
                rb.step_time_s[step] = rec["step_time_s"][step]
            if step in rec["pp_wait_s"]:
                rb.pp_wait_s[step] = rec["pp_wait_s"][step]
    add_saves(ranks, read_events(Path(run_dir) / "records"), {r: len(row["step_time_s"]) for r, row in records.items()})
    return [ranks[r] for r in sorted(ranks)]


def add_saves(ranks: dict[int, RankBreakdown], events: dict[int, list[dict[str, Any]]],
              recorded: dict[int, int]) -> None:
    """The collectors' ``checkpoint_save`` events (blocked time; the loop saves between steps, outside the trace
    window and the record's ``step_time_s``): a traced step that a save followed carries its blocked time in its
    ``checkpoint`` bucket and in its measured step (the step's buckets still add up to it); the rank's mean carries
    the run's blocked time per recorded step (``recorded``: steps per rank)."""
    for rank, rb in ranks.items():
        blocked = {(int(e.get("restart") or 0), int(e["step"])): float(e.get("seconds") or 0.0)
                   for e in events.get(rank, []) if e.get("event") == "checkpoint_save" and e.get("step") is not None}
        by_step = {step: sec for (_, step), sec in sorted(blocked.items())}  # a requeued step: its last start's save
        rb.checkpoint_per_step = sum(blocked.values()) / recorded[rank] if recorded.get(rank) else 0.0
        for step, b in rb.steps.items():
            if step in by_step:
                b["checkpoint"] = b.get("checkpoint", 0.0) + by_step[step]
                if step in rb.step_time_s:
                    rb.step_time_s[step] += by_step[step]
                rb.saved[step] = by_step[step]


def planned_terms(recipe: Any, layout: Any, ranks: list[RankBreakdown]) -> tuple[dict[str, float], str]:
    """The planner's terms for the run's recipe as buckets (seconds per step) and where they come from. CPU ranks
    have no peak for the planner to time: there the plan is its bubble term, (p-1)/(v m) of the stages' own time
    (the measured step less bubble, data and checkpoint), the one term that depends on the layout alone."""
    from hpc_tools.errors import UserError
    from hpc_tools.planner import plan_recipe

    if recipe is None:
        return {}, "no recipe in the run folder"
    try:
        plan = plan_recipe(recipe)
    except (UserError, ValueError) as e:
        return {}, f"no plan: {e}"
    if plan.time is not None:
        out = {b: 0.0 for b in bd.BUCKETS}
        for term, seconds in plan.time.terms.items():
            bucket = _TERM_BUCKET.get(term, "other")
            out[bucket] += seconds
        _mean_rank_bubble(plan, out)
        return out, (f"planner: {plan.hardware.gpu_type}, efficiency {plan.efficiency:.3g} "
                     f"({plan.efficiency_source})")
    bf = layout.bubble_fraction if layout is not None else 0.0
    work = stage_work(ranks)
    if layout is not None and layout.pipeline_size > 1 and sorted(work) == list(range(layout.pipeline_size)):
        p, m = layout.pipeline_size, max(layout.num_microbatches, 1)
        fwd, bwd = ps.equal_split([work[s] / m for s in range(p)], layout.virtual_pipeline_size or 1)
        sched = ps.simulate(fwd, bwd, m)
        return {"bubble": sched.mean_bubble}, (
            "planner's bubble under Megatron-core's schedule (planner/pipeline_schedule.py) for the stages' own work "
            "as traced (median step: " + ", ".join(f"stage {s} {work[s]:.3g} s" for s in range(p)) + "), mean over "
            "stages (" + ", ".join(f"{x.bubble:.3g}" for x in sched.stages) + f" s); equal stages: (p-1)/(v m) = "
            f"{bf:.3g} of their work; CPU ranks: no peak for the planner's other terms")
    own = [sum(b.values()) - b.get("bubble", 0.0) - b.get("data", 0.0) - b.get("checkpoint", 0.0)
           for r in ranks for b in r.steps.values()]
    if not own:
        return {}, "no traced steps"
    return {"bubble": bf * median(own)}, (f"planner's bubble term (p-1)/(v m) = {bf:.3g} of the stages' own time "
                                          "(the median traced step less its bubble and data; CPU ranks: no peak for "
                                          "the planner's other terms)")


def _mean_rank_bubble(plan: Any, out: dict[str, float]) -> None:
    """The planner's compute is the slowest stage's and its bubble term that stage's idle time; the buckets are means
    over ranks, and a faster stage computes less, idles longer in the fill and drain and waits in the steady state
    (comm.pp): the mean over the stages of each, from the same schedule, in seconds of the planned compute (still
    adding up to the planned step: every stage's work and idle time make the same step)."""
    lay, k = plan.knobs.layout, plan.knobs
    if lay.pipeline_size <= 1:
        return
    sched = ps.stage_schedule(plan.arch, lay.pipeline_size, k.virtual, lay.num_microbatches, lay.first_stage_layers,
                              lay.last_stage_layers, lay.tensor_size, 3.0 if k.recompute == "full" else 2.0)
    scale = plan.time.terms[st.COMPUTE] / (sched.slowest_busy or 1.0)
    out["compute"] -= scale * (sched.slowest_busy - sum(x.busy for x in sched.stages) / len(sched.stages))
    out["bubble"] += scale * sched.mean_bubble - plan.time.terms.get(st.BUBBLE, 0.0)
    out["comm.pp"] += scale * sched.mean_steady


def stage_work(ranks: list[RankBreakdown]) -> dict[int, float]:
    """{pipeline stage: its own work per step}: each rank's median over its traced steps (``work_s``), the mean over
    the stage's ranks."""
    by: dict[int, list[float]] = defaultdict(list)
    for r in ranks:
        if r.work_s:
            by[r.coords.get("pp_rank", 0)].append(median(r.work_s.values()))
    return {s: sum(v) / len(v) for s, v in by.items()}


def bubble_figures(b: "Breakdown") -> dict[str, float | None]:
    """The three bubbles of a run, seconds per step: the planner's (``planned``), the breakdown's and the collectors'
    pipeline wait (``pp_wait_s``), each rank's median over the traced steps, mean over the ranks; and the breakdown's
    exposed p2p in every phase (``breakdown_p2p``: the collectors' quantity, read from the trace)."""
    def over(values: list[list[float]]) -> float | None:
        meds = [median(v) for v in values if v]
        return sum(meds) / len(meds) if meds else None

    return {"planned": b.planned.get("bubble"),
            "breakdown": over([[s.get("bubble", 0.0) for s in r.steps.values()] for r in b.ranks]),
            "collectors": over([list(r.pp_wait_s.values()) for r in b.ranks]),
            "breakdown_p2p": over([list(r.p2p_s.values()) for r in b.ranks])}


def straggler(ranks: list[RankBreakdown]) -> dict[str, Any] | None:
    """The rank whose compute is longest, by how much over the median rank, and the ranks sharing a group with it
    and their wait in that group's buckets (comm.tp; bubble + comm.pp; comm.dp)."""
    if len(ranks) < 2:
        return None
    slow = max(ranks, key=lambda r: r.mean("compute"))
    mid = median(r.mean("compute") for r in ranks)
    waits = []
    for r in ranks:
        if r is slow:
            continue
        for dim, buckets in WAIT_BUCKETS.items():
            others = [d for d in ("tp", "pp", "dp") if d != dim]
            if all(r.coords.get(f"{d}_rank") == slow.coords.get(f"{d}_rank") for d in others):
                waits.append({"rank": r.rank, "group": dim, "wait_s": sum(r.mean(b) for b in buckets)})
    return {"rank": slow.rank, "compute_s": slow.mean("compute"), "over_median_s": slow.mean("compute") - mid,
            "waiting": waits}


def verdict(mean: dict[str, float], planned: dict[str, float], strag: dict[str, Any] | None) -> str:
    """One line: the bucket furthest above its planned term (the planner's zero where it plans none; compute only
    when planned) and its likely fix; then the rank the others wait for when its compute stands out."""
    gaps = {k: v - planned.get(k, 0.0) for k, v in mean.items() if k != "compute" or k in planned}
    if not gaps:
        return "no traced steps"
    k = max(gaps, key=gaps.get)
    plan = f"planned {planned[k]:.3g} s" if k in planned else "not planned"
    line = f"{k} {mean[k]:.3g} s/step, {plan}: {FIXES.get(k, 'a mixed group (e.g. the gradient norm): see the trace')}"
    # a quarter of its compute: on a loaded host the ranks' compute differs by 10-15 % with nothing injected
    if strag and strag["over_median_s"] > max(0.25 * strag["compute_s"], 0.005):
        waits = ", ".join(f"rank {w['rank']} in {w['group']} ({w['wait_s']:.3g} s)" for w in strag["waiting"])
        line += (f". Rank {strag['rank']}'s compute is the longest ({strag['compute_s']:.3g} s/step, "
                 f"+{strag['over_median_s']:.3g} s over the median rank)" + (f"; waiting for it: {waits}" if waits
                                                                              else ""))
    return line


def breakdown(run_input: Any, warmup: int | None = None) -> Breakdown:
    """The breakdown of one run (``analysis.inputs.RunInput``); warm-up steps (default ``profiling.warmup_steps``)
    are left out when later steps were traced."""
    recipe = run_input.recipe
    if warmup is None:
        warmup = recipe.profiling.warmup_steps if recipe is not None else 0
    ranks = measure(run_input.run.path, warmup)
    planned, source = planned_terms(recipe, run_input.layout, ranks)
    waits = [w for r in ranks for w in r.pp_wait_s.values()]
    strag = straggler(ranks)
    # a traced step shows one save's blocked time (checkpoint); what a save costs the steps after it is in the records
    after = post_save.measure(run_input.run.records_dir, warmup).as_dict()
    return Breakdown(run_input.run_id, ranks, planned, source, sum(waits) / len(waits) if waits else None,
                     verdict(mean_buckets(ranks), planned, strag), strag, after)


def format_text(b: Breakdown) -> str:
    """The breakdown as text: one row per rank (seconds per step), the mean, the plan and its ratio, the verdict."""
    js = b.to_json()
    cols = [k for k in js["mean"] if any(r["buckets"].get(k, 0.0) > 0 for r in js["ranks"]) or k in b.planned]
    head = f"{'rank':>4} {'step_s':>8} {'sum':>7} " + " ".join(f"{c:>10}" for c in cols)
    lines = [f"breakdown of {b.run_id} (seconds per traced step; traced steps: "
             f"{sorted({s for r in b.ranks for s in r.steps}) or 'none'})", head]
    for r in js["ranks"]:
        step = f"{r['step_s']:.4f}" if r["step_s"] is not None else "n/a"
        lines.append(f"{r['rank']:>4} {step:>8} {r['sum_s']:>7.4f} "
                     + " ".join(f"{r['buckets'].get(c, 0.0):>10.4f}" for c in cols))
    lines.append(f"{'mean':>4} {'':>8} {sum(js['mean'].values()):>7.4f} "
                 + " ".join(f"{js['mean'].get(c, 0.0):>10.4f}" for c in cols))
    if b.planned:
        lines.append(f"{'plan':>4} {'':>8} {'':>7} " + " ".join(
            f"{b.planned[c]:>10.4f}" if c in b.planned else f"{'':>10}" for c in cols))
        lines.append(f"{'x':>4} {'':>8} {'':>7} " + " ".join(
            f"{js['ratio'][c]:>10.2f}" if js["ratio"].get(c) is not None else f"{'':>10}" for c in cols))
    lines.append(f"plan: {b.planned_source}")
    fig = js["bubble"]
    if fig["collectors"] is not None or (fig["planned"] or 0.0) > 0:
        lines.append("bubble, median traced step, mean over ranks: " + ", ".join(
            f"{k} {v:.4f} s" for k, v in fig.items() if v is not None) + " (planned: idle in the schedule's fill and "
            "drain; breakdown: waits there; collectors and breakdown_p2p: every p2p wait, the steady state's too)")
    saved = sorted({s for r in b.ranks for s in r.saved_steps})
    if saved:
        lines.append(f"traced steps a checkpoint save followed: {saved} (its blocked time is in those steps' "
                     "checkpoint and step_s; the rows above carry the run's blocked save time per step)")
    lines.append(f"verdict: {b.verdict}")
    after = post_save.text(b.post_save)
    if after:
        lines.append(f"after saves: {after}")
    return "\n".join(lines)
