"""The cluster's network as Slurm describes it, and where a layout's parallel groups fall on it.

Slurm's ``scontrol show topology`` prints one line per switch of the topology/tree plugin (its
``_print_topo_record``: ``SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[1-4]``, ``Switches=s[0-1]`` on the switches
above the leaves, which list every node below them in ``Nodes=`` too) and one line per block of the topology/block
plugin (``BlockName=b1 BlockIndex=0 Nodes=n[1-4]``). Node and switch names are Slurm hostlist expressions
(``tux[0-3,12,18-20]``, topology.conf(5)). A node's *leaf* is the lowest-level switch (or the block) that lists it.

Megatron-core numbers the ranks of its groups tp-cp-ep-dp-pp (``RankGenerator``): a TP group is ``tensor_size``
consecutive ranks, a CP group ``context_size`` ranks ``tensor_size`` apart, an EP group (in the expert
decomposition, etp-ep-edp-pp) ``expert_size`` ranks ``expert_tensor_size`` apart. Ranks fill a node
(``ranks_per_node`` consecutive ranks each) and nodes come in the order srun is given. So a group stays inside a node
when its ranks do, and inside a leaf switch when their nodes share one: ``placement`` says, for a layout and the
node counts of the leaves, which node goes under which leaf so that TP, then CP, then EP groups stay inside one leaf
where the leaves can hold them, which kinds must still cross, and how many leaves (``--switches``) that uses;
``node_order`` applies it to an allocation (the order srun is given).

Standard library only: the batch shell's placement step (``hpc_tools.job.placement``) runs it with the host's python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hpc_tools.layout import ParallelLayout

_BRACKET = re.compile(r"\[([^\]]*)\]")


class TopologyError(ValueError):
    """Text that is not ``scontrol show topology`` output (the message names the line)."""


def expand_hostlist(expr: str) -> list[str]:
    """A Slurm hostlist expression as names, in order: ``n[1-3,7],gpu[01-02]`` -> n1 n2 n3 n7 gpu01 gpu02 (zero
    padding kept, as Slurm keeps it; several bracket groups in one name expand as a product, ``r[1-2]n[1-2]`` ->
    r1n1 r1n2 r2n1 r2n2). Raises TopologyError on an unbalanced bracket or a range that is not numeric."""
    out: list[str] = []
    for part in _split_top(expr.strip()):
        out.extend(_expand_one(part))
    return out


def _split_top(expr: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise TopologyError(f"hostlist {expr!r} closes a bracket it never opened")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise TopologyError(f"hostlist {expr!r} leaves a bracket open")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_one(name: str) -> list[str]:
    m = _BRACKET.search(name)
    if not m:
        if "[" in name or "]" in name:
            raise TopologyError(f"hostlist name {name!r} has a stray bracket")
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    out = []
    for item in m.group(1).split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise TopologyError(f"hostlist range {item!r} in {name!r} is not N or N-M")
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        stop = int(hi) if sep else int(lo)
        if stop < int(lo) or stop - int(lo) > 1 << 20:
            raise TopologyError(f"hostlist range {item!r} in {name!r} runs backwards or is too long")
        for i in range(int(lo), stop + 1):
            out.extend(head + str(i).zfill(width) + rest for rest in _expand_one(tail))
    return out


@dataclass(frozen=True, slots=True)
class Switch:
    """One line of ``scontrol show topology``: a switch (tree) or a block (block, level 0)."""

    name: str
    level: int
    nodes: tuple[str, ...]
    switches: tuple[str, ...] = ()
    link_speed: int | None = None


@dataclass(frozen=True, slots=True)
class Topology:
    """The switches (or blocks) of a cluster; ``kind`` is ``tree`` or ``block``."""

    kind: str
    switches: tuple[Switch, ...]
    _leaf: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        leaf: dict[str, tuple[int, str]] = {}
        for sw in self.switches:  # the lowest level listing a node is its leaf (upper switches list it too)
            for node in sw.nodes:
                if node not in leaf or sw.level < leaf[node][0]:
                    leaf[node] = (sw.level, sw.name)
        self._leaf.update({node: name for node, (_, name) in leaf.items()})

    def leaf_of(self, node: str) -> str | None:
        """The leaf switch (or block) of ``node``; None when the topology does not list it."""
        return self._leaf.get(node)

    def leaves(self) -> dict[str, list[str]]:
        """Each leaf switch (or block) with its nodes, in the topology's order."""
        out: dict[str, list[str]] = {}
        for node, leaf in self._leaf.items():
            out.setdefault(leaf, []).append(node)
        return out

    @property
    def unit(self) -> str:
        """What a leaf is called in messages."""
        return "block" if self.kind == "block" else "leaf switch"

    @property
    def units(self) -> str:
        return "blocks" if self.kind == "block" else "leaf switches"


_FIELD = re.compile(r"(\w+)=(\S*)")


def parse_topology(text: str) -> Topology:
    """``scontrol show topology`` output (tree or block plugin) as a Topology. Raises TopologyError naming the first
    line that is neither, or when there is no switch or block at all (Slurm's own "No topology information
    available" included)."""
    switches: list[Switch] = []
    kinds = set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("BlockSizes="):
            continue
        fields = dict(_FIELD.findall(line))
        if "SwitchName" in fields:
            kinds.add("tree")
            level = fields.get("Level", "0")
            if not level.isdigit():
                raise TopologyError(f"line {n} of the topology has Level={level!r}, not a number")
            speed = fields.get("LinkSpeed", "")
            switches.append(Switch(fields["SwitchName"], int(level), tuple(expand_hostlist(fields.get("Nodes", ""))),
                                   tuple(expand_hostlist(fields.get("Switches", ""))),
                                   int(speed) if speed.isdigit() else None))
        elif "BlockName" in fields:
            kinds.add("block")
            switches.append(Switch(fields["BlockName"], 0, tuple(expand_hostlist(fields.get("Nodes", "")))))
        else:
            raise TopologyError(f"line {n} of the topology is not a SwitchName= or BlockName= record: "
                                f"{line.strip()[:80]!r}")
    if not switches:
        raise TopologyError("the topology names no switch and no block (a cluster without a topology plugin)")
    if len(kinds) > 1:
        raise TopologyError("the topology mixes SwitchName= (tree) and BlockName= (block) records")
    return Topology(kinds.pop(), tuple(switches))


@dataclass(frozen=True, slots=True)
class GroupKind:
    """One kind of parallel group: ``size`` ranks ``stride`` apart (Megatron-core's rank order)."""

    name: str
    size: int
    stride: int

    @property
    def block(self) -> int:
        """Consecutive ranks that hold whole groups of this kind."""
        return self.size * self.stride

    def groups(self, world: int) -> list[range]:
        """The rank sets of every group of this kind."""
        return [range(base + off, base + self.block, self.stride)
                for base in range(0, world - world % self.block, self.block) for off in range(self.stride)]


def group_kinds(layout: ParallelLayout) -> list[GroupKind]:
    """The groups whose traffic is on the step's critical path, innermost first: TP, then CP, then EP (the checked
    kinds, in the order they should stay inside a node, then a leaf), then DP and PP (expected to cross)."""
    t, c, e = layout.tensor_size, layout.context_size, layout.expert_size
    etp = layout.expert_tensor_size or t
    return [GroupKind("TP", t, 1), GroupKind("CP", c, t), GroupKind("EP", e, etp),
            GroupKind("DP", layout.data_size, t * c), GroupKind("PP", layout.pipeline_size, t * c * layout.data_size)]


CHECKED = ("TP", "CP", "EP")


@dataclass(frozen=True, slots=True)
class Span:
    """Where the groups of one kind fall: the most nodes and leaves one group touches."""

    kind: GroupKind
    nodes: int
    leaves: int


def spans(layout: ParallelLayout, node_leaves: list[str | None]) -> list[Span]:
    """For each group kind of ``layout`` (size > 1), the most nodes and leaves one of its groups touches when node
    ``i`` of the step (in srun's order) sits under leaf ``node_leaves[i]`` (None: unknown, counted as a leaf of its
    own)."""
    rpn = layout.ranks_per_node
    out = []
    for kind in group_kinds(layout):
        if kind.size < 2:
            continue
        most_nodes = most_leaves = 1
        for group in kind.groups(layout.world_size):
            nodes = {r // rpn for r in group}
            leaves = {node_leaves[n] if n < len(node_leaves) and node_leaves[n] is not None else f"?{n}"
                      for n in nodes}
            most_nodes, most_leaves = max(most_nodes, len(nodes)), max(most_leaves, len(leaves))
        out.append(Span(kind, most_nodes, most_leaves))
    return out


@dataclass(frozen=True, slots=True)
class Placement:
    """The best a topology allows a layout: which node of the step goes under which leaf, and where the groups fall."""

    assignment: tuple[int | None, ...]
    """Leaf (an index into the ``leaf_sizes`` given) of each node of the step, in rank order; None: no room left."""
    kept: tuple[str, ...]
    """The checked kinds (TP, CP, EP) whose every group stays inside one leaf."""
    spans: list[Span]
    leaf_nodes: int
    """Nodes of the largest leaf."""

    @property
    def switches(self) -> int:
        """Leaves the placement uses (``--switches``)."""
        return len({a for a in self.assignment if a is not None}) or 1

    @property
    def short(self) -> int:
        """Nodes the leaves lack for the job (0: they have enough)."""
        return sum(a is None for a in self.assignment)

    def must_cross(self) -> list[Span]:
        """The checked kinds (TP, CP, EP) a group of which crosses leaves even in the best placement."""
        return [s for s in self.spans if s.kind.name in CHECKED and s.leaves > 1]


def _components(layout: ParallelLayout, kinds: list[GroupKind]) -> list[list[int]]:
    """The nodes of the step joined by the groups of ``kinds`` (a group's nodes must share a leaf), each set sorted,
    in order of their first node."""
    parent = list(range(layout.nodes))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for kind in kinds:
        for group in kind.groups(layout.world_size):
            nodes = sorted({r // layout.ranks_per_node for r in group})
            for n in nodes[1:]:
                parent[root(n)] = root(nodes[0])
    out: dict[int, list[int]] = {}
    for n in range(layout.nodes):
        out.setdefault(root(n), []).append(n)
    return list(out.values())


def _pack(components: list[list[int]], leaf_sizes: list[int]) -> list[int | None] | None:
    """Each node's leaf when the components go whole into leaves, largest first, each into the first leaf (largest
    leaves first) with room: None when one does not fit."""
    room = list(leaf_sizes)
    order = sorted(range(len(room)), key=lambda i: -room[i])
    out: list[int | None] = [None] * sum(len(c) for c in components)
    for comp in sorted(components, key=len, reverse=True):  # stable: equal sizes keep their node order
        leaf = next((i for i in order if room[i] >= len(comp)), None)
        if leaf is None:
            return None
        room[leaf] -= len(comp)
        for n in comp:
            out[n] = leaf
    return out


def placement(layout: ParallelLayout, leaf_sizes: list[int]) -> Placement:
    """Where ``layout``'s groups fall at best on leaves of ``leaf_sizes`` nodes: TP, then CP, then EP kept inside
    one leaf while the leaves can hold the nodes their groups join (a kind that cannot is left to cross, and the next
    is tried); the joined nodes go whole into the largest leaves first, the other nodes fill the room left, in rank
    order."""
    kinds = [k for k in group_kinds(layout) if k.name in CHECKED and k.size > 1]
    kept: list[GroupKind] = []
    best = _pack(_components(layout, []), leaf_sizes)
    for kind in kinds:
        packed = _pack(_components(layout, kept + [kind]), leaf_sizes)
        if packed is not None:
            kept.append(kind)
            best = packed
    if best is None:  # the leaves hold fewer nodes than the job: fill what there is, in rank order
        room = list(leaf_sizes)
        order = sorted(range(len(room)), key=lambda i: -room[i])
        best = []
        for _ in range(layout.nodes):
            leaf = next((i for i in order if room[i] > 0), None)
            best.append(leaf)
            if leaf is not None:
                room[leaf] -= 1
    names = [None if a is None else f"leaf{a}" for a in best]
    return Placement(tuple(best), tuple(k.name for k in kept), spans(layout, names), max(leaf_sizes, default=0))


def node_order(nodes: list[str], topology: Topology, layout: ParallelLayout) -> list[str] | None:
    """The step's ``nodes`` (an allocation, in Slurm's order) in rank order: node i of the result runs ranks
    ``i * ranks_per_node ...``, placed as ``placement`` places the layout on this allocation's leaves (the nodes of a
    leaf fill the places given to it in the allocation's order; with TP kept, a leaf's nodes are consecutive). None
    when a node is not in the topology or there are fewer nodes than the layout needs."""
    leaves: dict[str, list[str]] = {}
    for node in nodes:
        leaf = topology.leaf_of(node)
        if leaf is None:
            return None
        leaves.setdefault(leaf, []).append(node)
    if len(nodes) < layout.nodes:
        return None
    pools = list(leaves.values())
    best = placement(layout, [len(p) for p in pools])
    taken = [0] * len(pools)
    out = []
    for leaf in best.assignment:
        if leaf is None:  # unreachable with enough nodes: every node has its leaf's place
            return None
        out.append(pools[leaf][taken[leaf]])
        taken[leaf] += 1
    return out


def hostfile_lines(order: list[str], ranks_per_node: int) -> list[str]:
    """srun's arbitrary distribution file (``SLURM_HOSTFILE``): one line per task, task i on line i."""
    return [node for node in order for _ in range(ranks_per_node)]


def read_live(timeout_s: float) -> "Topology | str":
    """The live cluster's network (``scontrol show topology``), or why there is none (a string): no answer within
    ``timeout_s``, scontrol's own error (no topology plugin), or text that is not topology output."""
    from hpc_tools import slurm_client

    answer = slurm_client.show_topology(timeout_s)
    if answer.code is None:  # it did not run, or not within the time
        return f"scontrol show topology did not answer within {timeout_s:g} s ({answer.said})"
    if not answer.ok:
        return f"scontrol show topology failed ({answer.said[:120]})"
    try:
        return parse_topology(answer.out)
    except TopologyError as exc:
        return str(exc)
