"""Leaving a node that preflight named out of the run (docs/preflight.md, docs/fault-tolerance.md).

The rank program and the restart controller (``hpc_tools.job.restarts``) meet here; standard library only (the
controller runs on the batch host, outside the job's container).

- Before each rank step the controller exports what could replace a node: ``HPC_TOOLS_PREFLIGHT_SPARES`` (nodes of
  the allocation outside the step and not excluded, while an in-job restart is left) and
  ``HPC_TOOLS_PREFLIGHT_REQUEUE`` (1: the job may be requeued without the node), ``HPC_TOOLS_PREFLIGHT_FEWER`` (how
  many of the step's nodes an elastic job may go on without: ``cluster.min_nodes``), and ``HPC_TOOLS_PREFLIGHT_ACCEPT``
  (nodes named before that nothing could replace: the step trains on them).
- When preflight names nodes and ``replacement`` finds a way, rank 0 writes ``preflight-leave-out.json`` (this start,
  the nodes, each node's figures and reasons, the line) and every rank ends the step with ``EXIT_CODE``; the
  controller reads the marker (``read``) and starts the next step without the nodes, or requeues the job excluding
  them. Without a way, ``auto`` trains on (one line) and ``strict`` stops (one line).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

EXIT_CODE = 85  # every rank of a step that ends so its named nodes can be left out (hang: 86)
MARKER = "preflight-leave-out.json"
SPARES_ENV = "HPC_TOOLS_PREFLIGHT_SPARES"
REQUEUE_ENV = "HPC_TOOLS_PREFLIGHT_REQUEUE"
ROOM_ENV = "HPC_TOOLS_PREFLIGHT_REQUEUE_ROOM"  # nodes a requeued job could take instead (absent: no limit known)
ACCEPT_ENV = "HPC_TOOLS_PREFLIGHT_ACCEPT"
FEWER_ENV = "HPC_TOOLS_PREFLIGHT_FEWER"  # nodes an elastic job (cluster.min_nodes) may go on without
SPARE, REQUEUE = "a spare node takes its place", "the job is requeued without it"
FEWER = "training goes on without it (cluster.min_nodes)"


def accepted(env: Mapping[str, str]) -> list[str]:
    return [n for n in env.get(ACCEPT_ENV, "").split(",") if n]


def replacement(nodes: list[str], env: Mapping[str, str]) -> str | None:
    """How the named ``nodes`` can be left out of this run: ``SPARE``, ``FEWER``, ``REQUEUE`` or None (nothing can
    replace them: no restart loop around the step, no spare, elastic room or requeue left, or the nodes were accepted
    before)."""
    new = [n for n in nodes if n not in accepted(env)]
    if not new:
        return None
    if _count(env, SPARES_ENV, 0) >= len(new):
        return SPARE
    if _count(env, FEWER_ENV, 0) >= len(new):
        return FEWER
    return REQUEUE if env.get(REQUEUE_ENV) == "1" and _count(env, ROOM_ENV, len(new)) >= len(new) else None


def _count(env: Mapping[str, str], name: str, unset: int) -> int:
    """The number a hint variable holds (``unset`` when it is absent or empty, 0 when it is not a number)."""
    try:
        return int(env.get(name) or unset)
    except ValueError:
        return 0


def details(rows: list[Any], nodes: list[str]) -> dict[str, dict]:
    """Each named node's verdict, reasons and figures (``verdict.NodeRow``), for the manifest's record."""
    out = {}
    for r in rows:
        if r.node in nodes:
            out[r.node] = {"verdict": r.verdict, "reasons": list(r.reasons), "gemm_tflops": r.gemm_tflops,
                           "mem_gbps": r.mem_gbps, "busbw_gbps": r.busbw_gbps, "transport": r.transport}
    return out


def write(run_dir: Path, start: int, nodes: list[str], mode: str, line: str, how: str, about: dict,
          source: str = "preflight") -> Path:
    """The marker of start ``start``; ``source``: who named the nodes (``preflight`` before step 1, ``health``: the
    checks while training, ``hpc_tools.runtime.health``)."""
    path = Path(run_dir) / MARKER
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"start": start, "nodes": nodes, "mode": mode, "line": line, "how": how,
                               "details": about, "source": source}, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read(run_dir: Path, start: int) -> dict | None:
    """The marker of start ``start`` (an older start's marker is not this step's)."""
    try:
        data = json.loads((Path(run_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("start") == start and data.get("nodes") else None


class LeaveOut(Exception):
    """Raised on every rank when preflight named nodes that can be left out: the step ends with ``EXIT_CODE``."""

    exit_code = EXIT_CODE
    event = "preflight leave-out"  # the manifest's event, recorded by rank 0 with the marker
