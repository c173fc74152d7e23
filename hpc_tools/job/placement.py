"""Rank order by topology (``cluster.place_by_topology``): the batch shell's step before each rank step.

``python -m hpc_tools.job.placement --run-dir RUN --ranks-per-node N --sizes tensor=T,context=C,...`` reads the
step's nodes (``--nodes``: the restart controller's ``HPC_TOOLS_NODELIST``; else the job's ``SLURM_JOB_NODELIST``)
and the cluster's topology (``scontrol show topology``, tree or block plugin; ``hpc_tools.topology``), orders the
nodes so that TP, then CP and EP groups stay inside one leaf switch (or block) where this allocation's leaves can
hold them (``node_order``: with TP kept, the nodes of a leaf are consecutive), and prints, for the batch script to
``eval``:

* ordered: ``HPC_TOOLS_HOSTFILE=RUN/hostfile`` (the script gives it to the rank step's srun as SLURM_HOSTFILE),
  ``export MASTER_ADDR=<first node>`` and ``HPC_TOOLS_PLACE=(--distribution=arbitrary --ntasks=W)``: srun's arbitrary
  distribution lays task i on line i of that file (srun(1), ``-m arbitrary``), so rank i runs on the node the order
  gives it and Megatron-core's consecutive TP (then CP, EP) ranks share a node, then a leaf switch; rank 0 is on the
  first node, where the rendezvous must be;
* not ordered (no topology plugin, ``scontrol`` silent, a node the topology does not list): nothing to eval, one
  line on stderr why: the script's own ``HPC_TOOLS_PLACE`` (the step's ``--nodelist``, ``--nodes``/``--ntasks`` with
  spares) stands and the ranks keep Slurm's order.

Either way one line on stderr says where the groups fall in this allocation, naming a TP, CP or EP group that
crosses leaf switches (the allocation Slurm gave, ``--switches`` notwithstanding). Standard library only: it runs on
the batch host with the host's python (never inside a pyxis container).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from hpc_tools.layout import ParallelLayout
from hpc_tools.topology import (
    CHECKED,
    Topology,
    expand_hostlist,
    hostfile_lines,
    node_order,
    read_live,
    spans,
)

SCONTROL_TIMEOUT_S = 30.0
HOSTFILE = "hostfile"
SIZE_KEYS = ("tensor", "context", "expert", "expert_tensor", "pipeline", "data")


def read_topology(timeout_s: float = SCONTROL_TIMEOUT_S) -> Topology | str:
    """The live topology, or why there is none (a string)."""
    return read_live(timeout_s)


def layout_from(sizes: dict[str, int], nodes: int, ranks_per_node: int) -> ParallelLayout:
    return ParallelLayout(nodes=nodes, ranks_per_node=ranks_per_node, tensor_size=sizes["tensor"],
                          pipeline_size=sizes["pipeline"], data_size=sizes["data"], virtual_pipeline_size=None,
                          sequence_parallel=False, micro_batch_size=1, global_batch_size=sizes["data"],
                          context_size=sizes["context"], expert_size=sizes["expert"],
                          expert_tensor_size=sizes["expert_tensor"])


def describe(order: list[str], topology: Topology) -> str:
    """``s0: n1,n2 | s1: n3,n4``: the nodes in rank order, by leaf."""
    parts: list[tuple[str, list[str]]] = []
    for node in order:
        leaf = topology.leaf_of(node) or "?"
        if parts and parts[-1][0] == leaf:
            parts[-1][1].append(node)
        else:
            parts.append((leaf, [node]))
    return " | ".join(f"{leaf}: {','.join(nodes)}" for leaf, nodes in parts)


def plan(run_dir: Path, nodes: list[str], layout: ParallelLayout,
         topology: Topology | str) -> tuple[list[str], list[str]]:
    """(lines for the batch script to eval, lines for its log) for this step; writes the hostfile when ordered. Not
    ordered: no line to eval (the script's own node options stand) and one log line why."""
    if isinstance(topology, str):
        return [], [f"hpc_tools: placement: ranks in Slurm's order: {topology}"]
    missing = [n for n in nodes if topology.leaf_of(n) is None]
    if missing:
        return [], [f"hpc_tools: placement: ranks in Slurm's order: the topology does not list node "
                    f"{', '.join(missing[:4])}"]
    order = node_order(nodes, topology, layout)
    if order is None:
        return [], [f"hpc_tools: placement: ranks in Slurm's order: {len(nodes)} nodes given, the layout needs "
                    f"{layout.nodes}"]
    hostfile = run_dir / HOSTFILE
    hostfile.write_text("\n".join(hostfile_lines(order, layout.ranks_per_node)) + "\n")
    log = [f"hpc_tools: placement: ranks in topology order ({topology.units}): {describe(order, topology)}"]
    for s in spans(layout, [topology.leaf_of(n) for n in order]):
        if s.kind.name in CHECKED and s.leaves > 1:
            log.append(f"hpc_tools: placement: a {s.kind.name}{s.kind.size} group spans {s.leaves} "
                       f"{topology.units} in this allocation")
    exports = [f"HPC_TOOLS_HOSTFILE={shlex.quote(str(hostfile))}", f"export MASTER_ADDR={shlex.quote(order[0])}",
               f"HPC_TOOLS_PLACE=({shlex.join(['--distribution=arbitrary', f'--ntasks={layout.world_size}'])})"]
    return exports, log


def parse_sizes(text: str) -> dict[str, int]:
    sizes = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in SIZE_KEYS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--sizes item {item!r}: want KEY=N with KEY one of {', '.join(SIZE_KEYS)}")
        sizes[key] = int(value)
    missing = [k for k in SIZE_KEYS if k not in sizes]
    if missing:
        raise ValueError(f"--sizes lacks {', '.join(missing)}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.job.placement", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--ranks-per-node", required=True, type=int)
    parser.add_argument("--sizes", required=True, help="tensor=T,context=C,expert=E,expert_tensor=ET,pipeline=P,data=D")
    parser.add_argument("--nodes", default=None, help="the step's nodes (a hostlist); default SLURM_JOB_NODELIST")
    args = parser.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
        nodelist = args.nodes or os.environ.get("SLURM_JOB_NODELIST", "")
        nodes = expand_hostlist(nodelist)
        step_nodes = (sizes["tensor"] * sizes["context"] * sizes["pipeline"] * sizes["data"]) // args.ranks_per_node
        layout = layout_from(sizes, max(step_nodes, 1), args.ranks_per_node)
        exports, log = plan(args.run_dir, nodes, layout, read_topology())
    except Exception as exc:  # the batch script goes on in Slurm's order whatever happens here
        print(f"hpc_tools: placement: ranks in Slurm's order: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 0
    for line in log:
        print(line, file=sys.stderr)
    print("\n".join(exports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
