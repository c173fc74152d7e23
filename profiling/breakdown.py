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
        elif e["tid"] == main and not name.startswith(_NOT_OPS):
            t.spans["other" if name.startswith(_COMM_OPS) else "compute"].append((a, b))


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
        else:
            t.spans["compute" if e.get("cat") == "kernel" else "other"].append((a, b))


def sweep(t: StepTimeline, order: tuple[str, ...]) -> dict[str, float]:
    """Microseconds of the step window per label (``data``, ``compute``, ``comm:<pg>``, ``comm:p2p:<pg>``,
    ``checkpoint``, ``other``, ``host``): each instant goes to the first class of ``order`` active then; an instant
    with several collectives in flight is shared between their groups."""
    edges: list[tuple[float, int, str, str]] = []
    for kind, groups in (("call", t.calls), ("flight", t.flight)):
        if kind in order:
            for pg, ivs in groups.items():
                edges += [e for a, b in ivs for e in ((a, 1, kind, pg), (b, -1, kind, pg))]
    for kind, ivs in t.spans.items():
        edges += [e for a, b in ivs for e in ((a, 1, kind, ""), (b, -1, kind, ""))]
    edges.sort(key=lambda e: e[0])
    active: dict[str, Counter] = defaultdict(Counter)
    out: dict[str, float] = defaultdict(float)
    prev = t.start
    for ts, delta, kind, pg in edges + [(t.end, 0, "", "")]:
        a, b = max(prev, t.start), min(ts, t.end)
        if b > a:
            _assign(out, active, order, b - a)
        prev = max(prev, ts)
        if delta:
            active[kind][pg] += delta
            if active[kind][pg] <= 0:
                del active[kind][pg]
    return dict(out)


def _assign(out: dict[str, float], active: dict[str, Counter], order: tuple[str, ...], dt: float) -> None:
    for kind in order:
        if kind == "host":
            out["host"] += dt
            return
        if active.get(kind):
            if kind in ("call", "flight"):
                groups = list(active[kind])
                for pg in groups:
                    out["comm:" + pg] += dt / len(groups)
            else:
                out[kind] += dt
            return


def buckets(t: StepTimeline, dims: dict[str, str], gpu: bool = False,
            p2p_floor_us: float | None = None) -> dict[str, float]:
    """Seconds of the step per bucket (``BUCKETS``, plus ``comm.<mixed group>`` when one took time); they add up to
    the step window. Pipeline p2p: the transfers' own time (``p2p_floor_us``, the fastest p2p op of the step on any
    rank, by default this rank's, times their number: as if none had waited) is ``comm.pp``, the exposed rest the
    ``bubble`` (waiting for the other stage)."""
    raw = sweep(t, GPU_ORDER if gpu else CPU_ORDER)
    out = {b: 0.0 for b in BUCKETS}
    p2p = 0.0
    for label, us in raw.items():
        if label.startswith("comm:p2p:"):
            p2p += us
        elif label.startswith("comm:"):
            dim = dims.get(label[5:], "?")
            key = "other" if dim in ("self", "?") else f"comm.{dim}"
            out[key] = out.get(key, 0.0) + us
        else:
            out[label] = out.get(label, 0.0) + us
    floor = p2p_floor_us if p2p_floor_us is not None else min(t.p2p_ops, default=0.0)
    transfer = min(p2p, len(t.p2p_ops) * floor)
    out["comm.pp"] += transfer
    out["bubble"] += p2p - transfer
    return {k: v / 1e6 for k, v in out.items()}


def trace_rank(trace: dict[str, Any]) -> int | None:
    """The rank that wrote the trace (``distributedInfo.rank``)."""
    rank = (trace.get("distributedInfo") or {}).get("rank")
    return int(rank) if rank is not None else None


def is_gpu(trace: dict[str, Any]) -> bool:
    return any(e.get("cat") == "kernel" for e in trace.get("traceEvents", []))
