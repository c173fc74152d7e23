"""Where a traced step went: one rank's torch.profiler trace (``profiling.trace``) cut into buckets that add up to
the step, by a sweep over its timeline.

Buckets (seconds of one step on one rank): ``compute``, ``comm.<group>`` (exposed communication: time in flight and
not hidden by compute, per parallel group ``tp``, ``cp``, ``ep``, ``dp``, ``pp``, or a mixed group such as
``tp+pp``), ``bubble`` (exposed pipeline p2p beyond its transfer time), ``data``, ``checkpoint``, ``host`` (nothing
ran: launch and Python gaps), ``other`` (communication runtime calls outside any collective, copies on GPU).

The step is the job's own mark (``hpc_tools#step <n>``, start_step to end_step of the collector). Every instant of
it goes to exactly one bucket, the first that applies in the order of ``CPU_ORDER`` or ``GPU_ORDER``:

* CPU ranks (gloo): the rank's main thread runs the math; a collective is in flight while the main thread is in its
  call (``hpc_tools#comm`` mark: a synchronous op and the wait inside it) or while a gloo worker thread runs it
  (``gloo:*`` events, async ops such as Megatron's overlapped gradient reduction). Compute is the main thread's
  operators outside the collectives' calls; communication counts where compute does not cover it.
* GPU ranks: compute is the compute kernels of every stream, communication the NCCL kernels, each carrying its
  process group (``Process Group Name`` in the kernel's args, torch >= 2.3); data, checkpoint and host are the host
  marks while no kernel runs. Holistic Trace Analysis's temporal breakdown and comm/comp overlap compute the same
  sums for GPU kernels without groups or marks; this module keeps one sweep for both timelines.

A collective's parallel group comes from the trace's process-group record (``distributedInfo.pg_config``: name,
description, ranks): Megatron's description names it; otherwise the ranks' coordinates tell which of tp/pp/dp vary.
On gloo, each group runs its ops on its own worker threads: a worker thread's group is the one the job's marks name
most often just before its ops start.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from profiling.trace import COMM, COMPUTE, DATA, HOROVOD_PG, STEP

BUCKETS = ("compute", "comm.tp", "comm.cp", "comm.ep", "comm.dp", "comm.pp", "bubble", "data", "host", "checkpoint",
           "other")
CHECKPOINT = "hpc_tools#checkpoint"
CPU_ORDER = ("data", "checkpoint", "call", "compute", "flight", "other", "host")
GPU_ORDER = ("compute", "flight", "data", "checkpoint", "other", "host")
_COMM_OPS = ("gloo:", "c10d::", "nccl:", "record_param_comms")
_NOT_OPS = ("hpc_tools#", "ProfilerStep#", "PyTorch Profiler")
_BACKWARD = "autograd::engine::evaluate_function"
# allocations and bookkeeping around p2p (Megatron allocates a receive buffer, and frees a sent output with an empty
# tensor): not a forward
_BOOKKEEPING = ("aten::empty", "aten::zeros", "aten::zero_", "aten::fill_", "aten::detach", "detach", "aten::item",
                "aten::_local_scalar_dense", "aten::set_", "aten::resize_", "aten::record_stream")
PHASES = ("warm", "steady", "cool", "tail")  # fill, 1F1B, drain, after the last backward
_P2P_NAMES = ("gloo:send", "gloo:recv", "ncclDevKernel_SendRecv", "ncclKernel_SendRecv")
# Megatron-core's group descriptions (parallel_state.py), most specific first: the group's dimension
_DESCRIPTIONS = (("CONTEXT_PARALLEL", "cp"), ("EXPERT_MODEL_PARALLEL", "ep"), ("EXPERT_DATA", "dp"),
                 ("PIPELINE", "pp"), ("EMBEDDING", "pp"), ("TENSOR_MODEL_PARALLEL", "tp"),
                 ("EXPERT_TENSOR_PARALLEL", "tp"))
_STEP_RE = re.compile(rf"^{re.escape(STEP)} (\d+)$")
_COMM_RE = re.compile(rf"^{re.escape(COMM)} (\w+) pg=(\S+)$")


@dataclass(slots=True)
class StepTimeline:
    """One traced step of one rank: its window and labelled intervals (microseconds, trace clock)."""

    step: int
    start: float
    end: float
    spans: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    flight: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    calls: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    p2p_ops: list[float] = field(default_factory=list)  # durations of the p2p transfers (us)
    p2p_starts: list[float] = field(default_factory=list)  # their starts, same order
    # pipelined steps: (first backward's start, last forward's end, last backward's end), the schedule's phases
    cuts: tuple[float, float, float] | None = None
    _raw: dict[bool, dict[str, float]] = field(default_factory=dict)  # sweep per timeline kind (gpu), computed once


def read_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace file (``.json`` or ``.json.gz``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def group_dims(trace: dict[str, Any], coords: dict[int, dict[str, int]]) -> dict[str, str]:
    """{process group name: dimension} for every group of the trace: Megatron's description when it names one, else
    the coordinates (``tp_rank``, ``pp_rank``, ``dp_rank`` of each rank) that vary across its ranks; and ``horovod``
    (the job's mark of the wait for Horovod's all-reduces): dp."""
    out = {HOROVOD_PG: "dp"}  # Horovod all-reduces the gradients over every rank, outside torch's groups
    for pg in (trace.get("distributedInfo") or {}).get("pg_config", []):
        out[str(pg.get("pg_name"))] = dimension(str(pg.get("pg_desc", "")), list(pg.get("ranks") or []), coords)
    return out


def dimension(desc: str, ranks: list[int], coords: dict[int, dict[str, int]]) -> str:
    """The parallel dimension of a group: ``tp``, ``cp``, ``ep``, ``dp``, ``pp``, ``tp+pp`` ... or ``self`` (one
    rank), from its description or from which coordinates vary across ``ranks``."""
    upper = desc.upper()
    for key, dim in _DESCRIPTIONS:
        if key in upper and "_AND_" not in upper:
            return dim
    if upper.startswith("DATA_PARALLEL"):
        return "dp"
    if len(ranks) <= 1:
        return "self"
    known = [coords[r] for r in ranks if r in coords]
    varying = [d for d in ("tp", "pp", "dp") if len({c.get(f"{d}_rank", 0) for c in known}) > 1]
    return "+".join(varying) or "self"


def _threads(events: list[dict]) -> dict[Any, list[dict]]:
    by = defaultdict(list)
    for e in events:
        by[e.get("tid")].append(e)
    return by


def timelines(trace: dict[str, Any]) -> list[StepTimeline]:
    """The job-marked steps of a trace, each with its intervals (CPU or GPU, as the trace holds kernels or not)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [(int(m.group(1)), e) for e in events if (m := _STEP_RE.match(e.get("name", "")))]
    if not steps:
        return []
    main = steps[0][1]["tid"]
    host = [e for e in events if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    marks = _Marks([e for e in host if e["tid"] == main and _COMM_RE.match(e["name"])])
    owner = _worker_groups(host, main, marks)
    out = []
    for n, s in sorted(steps, key=lambda x: x[1]["ts"]):
        t = StepTimeline(n, s["ts"], s["ts"] + s["dur"])
        _host_intervals(t, host, main, marks, owner)
        if kernels:
            _kernel_intervals(t, kernels)
        if t.p2p_ops:
            t.cuts = _phases(t, host, main)
        out.append(t)
    return out


def _latest_mark(marks: "_Marks", ts: float) -> re.Match | None:
    """The comm mark that started last at or before ``ts``."""
    i = marks.index(ts)
    return _COMM_RE.match(marks[i - 1]["name"]) if i else None


class _Marks(list):
    """The job's comm marks on the main thread, sorted by start, with the starts of each group's marks: an async
    op is in flight from its call (the group's last mark before the worker ran it) to the worker's end."""

    def __init__(self, marks: list[dict]):
        super().__init__(sorted(marks, key=lambda e: e["ts"]))
        self.starts = [m["ts"] for m in self]
        self.by_pg: dict[str, list[float]] = defaultdict(list)
        for m in self:
            self.by_pg[_COMM_RE.match(m["name"]).group(2)].append(m["ts"])

    def index(self, ts: float) -> int:
        return bisect.bisect_right(self.starts, ts)

    def issued(self, pg: str, ts: float) -> float:
        """When the op of group ``pg`` that a worker started at ``ts`` was called (``ts`` without such a mark)."""
        starts = self.by_pg.get(pg, [])
        i = bisect.bisect_right(starts, ts)
        return starts[i - 1] if i else ts


def _worker_groups(host: list[dict], main, marks: "_Marks") -> dict[Any, str]:
    """{worker thread: process group name}: the group the marks just before its ops name most often."""
    votes: dict[Any, Counter] = defaultdict(Counter)
    for e in host:
        if e["tid"] != main and e["name"].startswith("gloo:"):
            m = _latest_mark(marks, e["ts"])
            if m:
                votes[e["tid"]][m.group(2)] += 1
    return {tid: c.most_common(1)[0][0] for tid, c in votes.items()}


def _is_p2p(kind_or_name: str) -> bool:
    return kind_or_name == "p2p" or kind_or_name.startswith(_P2P_NAMES)


def _host_intervals(t: StepTimeline, host: list[dict], main, marks: "_Marks", owner: dict[Any, str]) -> None:
    for e in host:
        a, b = e["ts"], e["ts"] + e["dur"]
        if b <= t.start or a >= t.end:
            continue
        name = e["name"]
        if name == DATA or name == CHECKPOINT or name == COMPUTE:
            t.spans[{DATA: "data", CHECKPOINT: "checkpoint", COMPUTE: "compute"}[name]].append((a, b))
        elif (m := _COMM_RE.match(name)) and e["tid"] == main:
            t.calls[("p2p:" if _is_p2p(m.group(1)) else "") + m.group(2)].append((a, b))
        elif name.startswith("gloo:"):
            m = _latest_mark(marks, a) if e["tid"] == main else None
            pg = m.group(2) if m else owner.get(e["tid"], "?")
            p2p = _is_p2p(name) or (m is not None and _is_p2p(m.group(1)))
            if e["tid"] == main:
                t.calls[("p2p:" if p2p else "") + pg].append((a, b))
            else:
                t.flight[("p2p:" if p2p else "") + pg].append((marks.issued(pg, a), b))
            if p2p:
                t.p2p_ops.append(e["dur"])
                t.p2p_starts.append(a)
        elif e["tid"] == main and not name.startswith(_NOT_OPS):
            t.spans["other" if name.startswith(_COMM_OPS) else "compute"].append((a, b))


def _phases(t: StepTimeline, host: list[dict], main) -> tuple[float, float, float] | None:
    """The pipeline schedule's phases of a step: (the first backward's start, the last forward's end, the last
    backward's end). Backward: the autograd engine's ``evaluate_function`` events (any thread: on GPUs the engine runs
    on its own); forward: the main thread's other operators outside them (and outside the communication calls, less
    allocations: ``_BOOKKEEPING``), before the last backward."""
    bwd = sorted((e["ts"], e["ts"] + e["dur"]) for e in host if e["name"].startswith(_BACKWARD)
                 and e["ts"] < t.end and e["ts"] + e["dur"] > t.start)
    if not bwd:
        return None
    merged: list[list[float]] = []
    for a, b in bwd:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [m[0] for m in merged]
    last_b = merged[-1][0]
    last_f = t.start
    for e in host:
        a, name = e["ts"], e["name"]
        if (e["tid"] != main or not t.start <= a < last_b or name.startswith(_BACKWARD) or name.startswith(_NOT_OPS)
                or name.startswith(_COMM_OPS) or name.startswith(_BOOKKEEPING)):
            continue
        i = bisect.bisect_right(starts, a)
        if i and a < merged[i - 1][1]:  # inside a backward (the engine runs CPU backwards on the main thread)
            continue
        last_f = max(last_f, a + e["dur"])
    return merged[0][0], max(last_f, merged[0][0]), merged[-1][1]


def _kernel_intervals(t: StepTimeline, kernels: Iterable[dict]) -> None:
    """GPU: kernels replace the host's operators as compute; NCCL kernels are the communication in flight."""
    t.spans["compute"], t.spans["other"] = [], []  # on GPU the host's operators only launch kernels
    for e in kernels:
        a, b = e["ts"], e["ts"] + e["dur"]
        if b <= t.start or a >= t.end:
            continue
        args, name = e.get("args") or {}, e["name"]
        if name.lower().startswith("nccl"):
            p2p = _is_p2p(name) or str(args.get("Collective name", "")).lower() in ("send", "recv", "sendrecv")
            t.flight[("p2p:" if p2p else "") + str(args.get("Process Group Name", "?"))].append((a, b))
            if p2p:
                t.p2p_ops.append(e["dur"])
                t.p2p_starts.append(a)
        else:
            t.spans["compute" if e.get("cat") == "kernel" else "other"].append((a, b))


def sweep(t: StepTimeline, order: tuple[str, ...]) -> dict[str, float]:
    """Microseconds of the step window per label (``data``, ``compute``, ``comm:<pg>``, ``comm:p2p:<pg>``,
    ``checkpoint``, ``other``, ``host``): each instant goes to the first class of ``order`` active then; an instant
    with several collectives in flight is shared between their groups. A pipelined step (``t.cuts``) has each label
    per phase of the schedule: ``<label>@warm``, ``@steady``, ``@cool``, ``@tail`` (``PHASES``)."""
    edges: list[tuple[float, int, str, str]] = []
    for kind, groups in (("call", t.calls), ("flight", t.flight)):
        if kind in order:
            for pg, ivs in groups.items():
                edges += [e for a, b in ivs for e in ((a, 1, kind, pg), (b, -1, kind, pg))]
    for kind, ivs in t.spans.items():
        edges += [e for a, b in ivs for e in ((a, 1, kind, ""), (b, -1, kind, ""))]
    cuts = t.cuts or ()
    edges += [(c, 0, "", "") for c in cuts]  # no interval straddles a phase's edge
    edges.sort(key=lambda e: e[0])
    active: dict[str, Counter] = defaultdict(Counter)
    out: dict[str, float] = defaultdict(float)
    prev = t.start
    for ts, delta, kind, pg in edges + [(t.end, 0, "", "")]:
        a, b = max(prev, t.start), min(ts, t.end)
        if b > a:
            phase = f"@{PHASES[bisect.bisect_right(cuts, a)]}" if cuts else ""
            _assign(out, active, order, b - a, phase)
        prev = max(prev, ts)
        if delta:
            active[kind][pg] += delta
            if active[kind][pg] <= 0:
                del active[kind][pg]
    return dict(out)


def _assign(out: dict[str, float], active: dict[str, Counter], order: tuple[str, ...], dt: float,
            phase: str = "") -> None:
    for kind in order:
        if kind == "host":
            out["host" + phase] += dt
            return
        if active.get(kind):
            if kind in ("call", "flight"):
                groups = list(active[kind])
                for pg in groups:
                    out["comm:" + pg + phase] += dt / len(groups)
            else:
                out[kind + phase] += dt
            return


def _sweep(t: StepTimeline, gpu: bool) -> dict[str, float]:
    if gpu not in t._raw:
        t._raw[gpu] = sweep(t, GPU_ORDER if gpu else CPU_ORDER)
    return t._raw[gpu]


def _comm_key(pg: str, dims: dict[str, str]) -> tuple[str, str]:
    dim = dims.get(pg, "?")
    return ("other" if dim in ("self", "?") else f"comm.{dim}"), dim


def tail_us(t: StepTimeline, dims: dict[str, str], gpu: bool = False) -> dict[str, float]:
    """Microseconds per bucket in collectives of groups that span pipeline stages (embedding, model-parallel, world:
    a dimension with ``pp``) after the rank's last backward: where a stage that finished its backwards waits while the
    earlier stages drain (nothing when the step is not pipelined)."""
    out: dict[str, float] = defaultdict(float)
    for label, us in _sweep(t, gpu).items():
        base, _, phase = label.partition("@")
        if phase == "tail" and base.startswith("comm:") and not base.startswith("comm:p2p:"):
            key, dim = _comm_key(base[5:], dims)
            if "pp" in dim.split("+"):
                out[key] += us
    return dict(out)


def p2p_wait_s(t: StepTimeline, gpu: bool = False) -> float:
    """Seconds of exposed pipeline p2p in the step, every phase: what the collectors' ``pp_wait_s`` measures."""
    return sum(us for label, us in _sweep(t, gpu).items() if label.startswith("comm:p2p:")) / 1e6


def pipeline_work_s(t: StepTimeline, gpu: bool = False) -> float | None:
    """Seconds of the step, up to the rank's last backward, that the rank spent on its own forwards and backwards
    (everything but pipeline p2p, data and checkpoint): its stage's work in the schedule; None when not pipelined."""
    if t.cuts is None:
        return None
    return sum(us for label, us in _sweep(t, gpu).items()
               if (parts := label.partition("@"))[2] in ("warm", "steady", "cool")
               and not parts[0].startswith("comm:p2p:") and parts[0] not in ("data", "checkpoint")) / 1e6


def buckets(t: StepTimeline, dims: dict[str, str], gpu: bool = False, p2p_floor_us: float | None = None,
            tail_floor_us: float | None = None) -> dict[str, float]:
    """Seconds of the step per bucket (``BUCKETS``, plus ``comm.<mixed group>`` when one took time); they add up to
    the step window.

    Pipeline waits go by when they happen in the schedule (``t.cuts``): exposed p2p in the fill (before the rank's
    first backward), the drain (after its last forward) or after its last backward is the ``bubble``, less the
    transfers' own time (``p2p_floor_us``, the fastest p2p op of the step on any rank, by default this rank's, times
    their number: ``comm.pp``); p2p in the 1F1B steady state between, waiting on a send/recv for a slower neighbour, is
    ``comm.pp``. After the last backward, the time in collectives spanning stages (``tail_us``) beyond
    ``tail_floor_us`` (the least any rank of the step spent there: the collectives' own time; by default this rank's)
    is the ``bubble`` too: a later stage waits there while the earlier ones drain. A step without phases (no backward
    in the trace) has all its p2p as fill and drain."""
    out = {b: 0.0 for b in BUCKETS}
    idle = 0.0
    for label, us in _sweep(t, gpu).items():
        base, _, phase = label.partition("@")
        if base.startswith("comm:p2p:"):
            if phase == "steady":
                out["comm.pp"] += us
            else:
                idle += us
        elif base.startswith("comm:"):
            key = _comm_key(base[5:], dims)[0]
            out[key] = out.get(key, 0.0) + us
        else:
            out[base] = out.get(base, 0.0) + us
    floor = p2p_floor_us if p2p_floor_us is not None else min(t.p2p_ops, default=0.0)
    if t.cuts:
        steady = (t.cuts[0], max(t.cuts[0], t.cuts[1]))
        ops = sum(1 for a in t.p2p_starts if not steady[0] <= a < steady[1])
    else:
        ops = len(t.p2p_ops)
    transfer = min(idle, ops * floor)
    out["comm.pp"] += transfer
    out["bubble"] += idle - transfer
    tail = tail_us(t, dims, gpu)
    total = sum(tail.values())
    excess = max(0.0, total - (tail_floor_us if tail_floor_us is not None else total))
    for key, us in tail.items():
        out[key] -= excess * us / total
    out["bubble"] += excess
    return {k: v / 1e6 for k, v in out.items()}


def trace_rank(trace: dict[str, Any]) -> int | None:
    """The rank that wrote the trace (``distributedInfo.rank``)."""
    rank = (trace.get("distributedInfo") or {}).get("rank")
    return int(rank) if rank is not None else None


def is_gpu(trace: dict[str, Any]) -> bool:
    return any(e.get("cat") == "kernel" for e in trace.get("traceEvents", []))
