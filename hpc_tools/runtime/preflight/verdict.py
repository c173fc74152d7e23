"""Preflight's figures and verdicts, without torch: the thresholds, bus bandwidth, the transport a communicator used,
the per-node table and its JSON (``preflight.json`` in the run folder). docs/preflight.md explains each rule.

Thresholds (one owner each, here):

- ``SLOW_FACTOR`` = 0.7: a node whose GEMM TFLOP/s, memory GB/s or intra-node bus bandwidth is below 0.7 x the
  median of the nodes is *slow*. In a synchronous step every rank waits for the slowest, so one node at 0.7 x
  costs the whole job 30 % of its speed; healthy nodes of one type measure within a few per cent of each other
  (thermal and clock variation), far inside the margin, so the median of several nodes is a fair stand-in for
  "what this hardware does here" even where no table has the figure (CPU ranks, an unknown GPU).
- ``PEAK_FLOOR`` = 0.25: a GEMM below a quarter of the hardware table's dense peak (``profiling.peaks``) is slow
  even when every node is (a node of the wrong type, clocks held down, a GPU in a degraded state): the preflight
  GEMM is large enough on a GPU (8192^3) to reach well over half the peak on a healthy one.
- ``EXPECTED_FLOOR`` = 0.5: the whole job's all-reduce bus bandwidth below half the planner's expected figure for
  its link (``cluster.inter_node_bw_gbps`` / ``intra_node_bw_gbps``, else the planner's hardware table, given by
  the command or the recipe) is a job-level problem: the planner's figures are large-message asymptotes, and the
  preflight's messages are the layout's own, smaller ones, hence the wider margin.

Bus bandwidth follows nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): algbw = bytes / time, and
busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather and all-to-all (``bytes`` the whole buffer), so
that one figure compares with the link's speed whatever n is.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpc_tools.errors import UserError

SLOW_FACTOR = 0.7
PEAK_FLOOR = 0.25
EXPECTED_FLOOR = 0.5
REPORT_NAME = "preflight.json"
OK, SLOW, FAILED, TRANSPORT = "ok", "slow", "failed", "transport"
VERDICT_ORDER = (FAILED, TRANSPORT, SLOW, OK)  # a node's verdict: the first of its reasons' kinds in this order

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "all_to_all": lambda n: (n - 1) / n}


class PreflightFailed(UserError):
    """``cluster.preflight: strict`` and a node was named: one line with the node, the figure and the reason."""

    exit_code = 1


def busbw_gbps(op: str, nbytes: float, seconds: float, n: int) -> float | None:
    """Bus bandwidth in GB/s of one ``op`` ('all_reduce', 'all_gather', 'all_to_all') moving a buffer of ``nbytes``
    over ``n`` ranks in ``seconds`` (nccl-tests' convention, module docstring); None for one rank or no time."""
    if n < 2 or seconds <= 0:
        return None
    return nbytes / seconds * BUS_FACTOR[op](n) / 1e9


# --- the transport a communicator chose ------------------------------------------------------------------------------
# NCCL's INFO lines (NCCL_DEBUG=INFO), as NCCL 2.28 writes them: per communicator "Using network Socket" (or IB),
# per channel "Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA", and the devices "NET/IB : Using
# [0]mlx5_0:1/RoCE ; OOB eth0:..." ("NET/IB : Using [RO]; OOB ..." is printed too when IB then fails to initialize,
# so that line alone decides nothing).
_NCCL_VIA = re.compile(r"via NET/(IB|Socket)")
_NCCL_NETWORK = re.compile(r"Using network (IB|Socket)\b")
_NCCL_DEVICES = re.compile(r"NET/IB\s*:\s*Using\s+(\[\d+\]\S+)")


def nccl_transport(text: str) -> str | None:
    """The inter-node transport NCCL used, from its INFO lines: ``NET/IB``, ``NET/IB/RoCE`` or ``NET/Socket`` (the
    channels' ``via NET/...`` lines decide, else the communicators' ``Using network ...`` lines); None when no line
    says."""
    via = set(_NCCL_VIA.findall(text)) or set(_NCCL_NETWORK.findall(text))
    if not via:
        return None
    kind = "Socket" if "Socket" in via else "IB"
    roce = any("/RoCE" in dev for dev in _NCCL_DEVICES.findall(text))
    return f"NET/{kind}" + ("/RoCE" if kind == "IB" and roce else "")


def gloo_transport(interface: str | None, address: str | None) -> str:
    """How a gloo rank's transport is shown: ``gloo:<interface> <address>``."""
    return f"gloo:{interface or '?'} {address or '?'}"


def gloo_interface(transport: str | None) -> str | None:
    if not transport or not transport.startswith("gloo:"):
        return None
    name = transport[5:].split(" ", 1)[0]
    return None if name == "?" else name


def expected_transport(gpu: bool, env: Mapping[str, str], multi_node: bool) -> tuple[str | None, str]:
    """(what the transport should be, where that comes from). The repository has no fabric field in its site
    configuration: on CPU the interface the recipe gives gloo (``GLOO_SOCKET_IFNAME`` in ``cluster.setup.env``),
    else none (the nodes are compared with each other); on GPU across nodes InfiniBand/RoCE (``NET/IB``) unless
    the recipe turns it off (``NCCL_IB_DISABLE=1`` or ``NCCL_NET=Socket``)."""
    if not gpu:
        name = (env.get("GLOO_SOCKET_IFNAME") or "").split(",")[0].strip()
        return (name or None), ("cluster.setup.env GLOO_SOCKET_IFNAME" if name else "the other nodes")
    if not multi_node:
        return None, "one node: no network transport"
    if env.get("NCCL_IB_DISABLE", "").strip() == "1" or env.get("NCCL_NET", "").strip().lower() == "socket":
        return "NET/Socket", "cluster.setup.env (NCCL_IB_DISABLE / NCCL_NET)"
    return "NET/IB", "a multi-node GPU job (InfiniBand or RoCE unless the recipe turns it off)"


def transport_reasons(transports: Mapping[str, str | None], expected: str | None, gpu: bool,
                      hosts: Mapping[str, str] | None = None) -> dict[str, str]:
    """node -> why its transport is wrong, for the nodes whose transport is (module docstring of ``run``)."""
    out: dict[str, str] = {}
    if gpu:
        if expected is None:
            return out
        for node, t in transports.items():
            if t is not None and not t.startswith(expected):
                out[node] = (f"transport {t}, not {expected}: NCCL fell back to TCP sockets, which collapses "
                             "multi-node throughput (check the IB/RoCE devices, NCCL_IB_HCA, the container's rdma "
                             "libraries)" if t == "NET/Socket" else f"transport {t}, not {expected}")
        return out
    names = {node: gloo_interface(t) for node, t in transports.items()}
    distinct_hosts = len(set((hosts or {}).values())) > 1
    if expected is None:
        seen = [n for n in names.values() if n]
        common = statistics.mode(seen) if seen else None
        if len(set(seen)) > 1 and seen.count(common) > len(seen) / 2:
            expected = common
    for node, name in names.items():
        if name is None:
            continue
        if expected is not None and name != expected:
            out[node] = f"gloo uses interface {name}, not {expected} like the others"
        elif name == "lo" and distinct_hosts:
            out[node] = "gloo uses the loopback interface lo in a job across hosts (set GLOO_SOCKET_IFNAME)"
    return out


# --- the per-node table ----------------------------------------------------------------------------------------------
@dataclass
class RankResult:
    """One rank's own measurements (``None``: not measured)."""

    rank: int
    node: str
    host: str = ""
    gemm_tflops: float | None = None
    mem_gbps: float | None = None
    transport: str | None = None
    error: str | None = None
    health: list[tuple[str, str]] = field(default_factory=list)
    """NVML's findings on this rank's GPU, (kind, reason) (``measure.nvml_findings``)."""


@dataclass
class NodeRow:
    """One node's line of the table: its slowest rank's figures, its collectives and its verdict with reasons."""

    node: str
    ranks: list[int]
    gemm_tflops: float | None = None
    mem_gbps: float | None = None
    busbw_gbps: float | None = None
    intra_gbps: float | None = None
    transport: str | None = None
    verdict: str = OK
    reasons: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)

    def name(self, kind: str, reason: str) -> None:
        self.reasons.append(reason)
        self.kinds.append(kind)
        self.verdict = min(self.kinds, key=VERDICT_ORDER.index)


def _min(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


MIN_NODES_FOR_MEDIAN = 3
"""Nodes a comparison with the node median needs: the median of two is their mean, and which of two is abnormal
(one slow, or the other fast) it cannot tell from a small gap; on a loaded host two healthy nodes differed by 2x.
Two nodes are compared with each other by ``TWO_NODE_FACTOR`` instead (and the hardware peak still judges)."""
TWO_NODE_FACTOR = 0.35
"""Two nodes: the slower is named when below 0.35x the other. A gap that large is a fault (a node throttled, a
fifth of its speed), not the 2x two healthy nodes of a loaded host measured; the slower one is the abnormal one,
since no fault makes a node faster."""


def _relative(rows: list[NodeRow], attr: str, label: str, unit: str, factor: float = SLOW_FACTOR) -> None:
    values = [getattr(r, attr) for r in rows if getattr(r, attr) is not None]
    if len(values) == 2:
        low, high = sorted(values)
        for r in rows:
            if getattr(r, attr) == low and high > 0 and low < TWO_NODE_FACTOR * high:
                r.name(SLOW, f"{label} {low:.3g} {unit} is {low / high:.2f}x the other node's {high:.3g} (two "
                             f"nodes: below {TWO_NODE_FACTOR}x)")
                break
        return
    if len(values) < MIN_NODES_FOR_MEDIAN:
        return
    med = statistics.median(values)
    for r in rows:
        v = getattr(r, attr)
        if v is not None and med > 0 and v < factor * med:
            r.name(SLOW, f"{label} {v:.3g} {unit} is {v / med:.2f}x the node median {med:.3g} (below {factor}x)")


def judge(ranks: list[RankResult], *, busbw: Mapping[str, float | None] | None = None,
          intra: Mapping[str, float | None] | None = None, peak_tflops: float | None = None,
          link_reasons: Mapping[str, str] | None = None, transport_why: Mapping[str, str] | None = None
          ) -> list[NodeRow]:
    """The table: one row per node (in first-rank order) with its verdict. A node's GEMM and memory figures are
    its slowest rank's; ``busbw`` / ``intra``: each node's inter-node and intra-node all-reduce bus bandwidth;
    ``link_reasons``: nodes the bisection named (``bisect``), with why; ``transport_why``: nodes whose transport is
    wrong (``transport_reasons``)."""
    by_node: dict[str, list[RankResult]] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        by_node.setdefault(r.node, []).append(r)
    rows = []
    for node, rs in by_node.items():
        transports = sorted({r.transport for r in rs if r.transport})
        row = NodeRow(node=node, ranks=[r.rank for r in rs], gemm_tflops=_min(r.gemm_tflops for r in rs),
                      mem_gbps=_min(r.mem_gbps for r in rs), busbw_gbps=(busbw or {}).get(node),
                      intra_gbps=(intra or {}).get(node), transport=", ".join(transports) or None)
        for r in rs:
            if r.error:
                row.name(FAILED, f"rank {r.rank} failed: {r.error}")
            for kind, reason in r.health:
                row.name(kind, f"rank {r.rank} GPU: {reason}")
        rows.append(row)
    _relative(rows, "gemm_tflops", "GEMM", "TFLOP/s")
    _relative(rows, "mem_gbps", "memory bandwidth", "GB/s")
    _relative(rows, "intra_gbps", "intra-node all-reduce busbw", "GB/s")
    if peak_tflops:
        for r in rows:
            if r.gemm_tflops is not None and r.gemm_tflops < PEAK_FLOOR * peak_tflops:
                r.name(SLOW, f"GEMM {r.gemm_tflops:.3g} TFLOP/s is {r.gemm_tflops / peak_tflops:.2f}x the hardware "
                             f"peak {peak_tflops:.4g} (below {PEAK_FLOOR}x)")
    for r in rows:
        if (link_reasons or {}).get(r.node):
            r.name(SLOW, link_reasons[r.node])
        if (transport_why or {}).get(r.node):
            r.name(TRANSPORT, transport_why[r.node])
    return rows


def named(rows: list[NodeRow]) -> list[NodeRow]:
    return [r for r in rows if r.verdict != OK]


def failure_line(rows: list[NodeRow], problems: list[str], mode: str) -> str:
    """One line: every named node with its verdict and reasons, then the job-level problems."""
    parts = [f"node {r.node} {r.verdict}: {'; '.join(r.reasons)}" for r in named(rows)] + problems
    return f"preflight (cluster.preflight={mode}): " + " | ".join(parts)


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def table_lines(rows: list[NodeRow]) -> list[str]:
    """The table as text, one line per node, the reason of a named node after its verdict."""
    head = ("node", "ranks", "GEMM TFLOP/s", "mem GB/s", "busbw GB/s", "intra GB/s", "transport", "verdict")
    body = [(r.node, ",".join(map(str, r.ranks)) if len(r.ranks) < 5 else f"{r.ranks[0]}-{r.ranks[-1]}",
             _fmt(r.gemm_tflops), _fmt(r.mem_gbps), _fmt(r.busbw_gbps), _fmt(r.intra_gbps), r.transport or "-",
             r.verdict + (f" ({'; '.join(r.reasons)})" if r.reasons else "")) for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head) - 1)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(line[:-1], widths)) + "  " + line[-1] for line in [head, *body]]


@dataclass
class Report:
    """What ``preflight.json`` holds."""

    mode: str
    budget_s: float
    seconds: float
    rows: list[NodeRow]
    problems: list[str] = field(default_factory=list)
    collectives: dict[str, Any] = field(default_factory=dict)
    search: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not named(self.rows) and not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"version": 1, "mode": self.mode, "budget_s": self.budget_s, "seconds": round(self.seconds, 3),
                "healthy": self.healthy, "named": [r.node for r in named(self.rows)], "problems": self.problems,
                "nodes": [asdict(r) for r in self.rows], "collectives": self.collectives, "search": self.search,
                "notes": self.notes, "thresholds": {"slow_factor": SLOW_FACTOR, "peak_floor": PEAK_FLOOR,
                                                    "expected_floor": EXPECTED_FLOOR,
                                                    "two_node_factor": TWO_NODE_FACTOR}}

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / REPORT_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=2, default=str) + "\n")
        tmp.replace(path)
        return path


def read_report(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / REPORT_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rows_from_dict(data: Mapping[str, Any]) -> list[NodeRow]:
    return [NodeRow(**row) for row in data.get("nodes", [])]
