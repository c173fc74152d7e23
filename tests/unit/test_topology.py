"""Placement by topology (issue 34 item 2): Slurm's topology text and hostlists parsed, an allocation's nodes put in
rank order so that TP, then CP and EP groups stay inside a leaf switch, `validate` warning (exit 0) when a layout
cannot, and the rendered script asking for --switches and ordering the ranks at run time (its placement lines run in
bash with a stand-in `scontrol` printing a two-switch topology; the real cluster check is the lead's).

The topology fixtures have the shape of Slurm's own output (topology/tree ``_print_topo_record``: ``SwitchName=%s
Level=%u LinkSpeed=%u`` then `` Nodes=%s`` and `` Switches=%s`` when set; older versions end each field with a space;
topology/block: ``BlockName=%s BlockIndex=%u Nodes=%s``)."""

from __future__ import annotations

import itertools
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_tools.job.placement import plan
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import resolve
from hpc_tools.render.sbatch import render_sbatch
from hpc_tools.topology import (
    TopologyError,
    expand_hostlist,
    hostfile_lines,
    node_order,
    parse_topology,
    placement,
)
from tests.helpers import REPO
from tests.unit.test_render import small_recipe

TWO_SWITCHES = """\
SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[1-2]
SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[3-4]
SwitchName=top Level=1 LinkSpeed=1 Nodes=n[1-4] Switches=s[0-1]
"""
# The same shape, with each leaf's nodes interleaved in Slurm's node order: the allocation n[1-4] in Slurm's order
# puts n1 and n2 (different switches) under one TP8 group of 4-GPU nodes.
INTERLEAVED = """\
SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[1,3]
SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[2,4]
SwitchName=top Level=1 LinkSpeed=1 Nodes=n[1-4] Switches=s[0-1]
"""


TP8 = ["backend.kind=megatron", "parallel.tensor_size=8", "parallel.pipeline_size=1", "model.num_attention_heads=8"]


def layout(nodes: int, rpn: int, tp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None, pp: int = 1):
    data = nodes * rpn // (tp * cp * pp)
    return ParallelLayout(nodes=nodes, ranks_per_node=rpn, tensor_size=tp, pipeline_size=pp, data_size=data,
                          virtual_pipeline_size=None, sequence_parallel=False, micro_batch_size=1,
                          global_batch_size=data, context_size=cp, expert_size=ep,
                          expert_tensor_size=1 if etp is None else etp)


# -- hostlists and the topology text --------------------------------------------------------------------------------

@pytest.mark.parametrize("expr, names", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2,7],gpu[01-02]", ["n1", "n2", "n7", "gpu01", "gpu02"]),
    ("tux[0-3,12,18-20]", ["tux0", "tux1", "tux2", "tux3", "tux12", "tux18", "tux19", "tux20"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("", []),
])
def test_hostlists_expand_as_slurm_writes_them(expr, names):
    assert expand_hostlist(expr) == names


@pytest.mark.parametrize("expr", ["n[1-3", "n1-3]", "n[a-b]", "n[3-1]", "n[1-]"])
def test_a_malformed_hostlist_is_refused(expr):
    with pytest.raises(TopologyError):
        expand_hostlist(expr)


def test_nested_switches_give_each_node_its_lowest_switch():
    text = ("SwitchName=core Level=2 LinkSpeed=1 Nodes=gpu[001-008] Switches=agg[0-1]\n"
            "SwitchName=agg0 Level=1 LinkSpeed=1 Nodes=gpu[001-004] Switches=leaf[0-1]\n"
            "SwitchName=agg1 Level=1 LinkSpeed=1 Nodes=gpu[005-008] Switches=leaf[2-3]\n"
            "SwitchName=leaf0 Level=0 LinkSpeed=1 Nodes=gpu[001-002]\n"
            "SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=gpu[003-004]\n"
            "SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=gpu[005-006]\n"
            "SwitchName=leaf3 Level=0 LinkSpeed=1 Nodes=gpu[007-008]\n")
    topo = parse_topology(text)
    assert topo.kind == "tree"
    assert [topo.leaf_of(f"gpu{i:03d}") for i in range(1, 9)] == ["leaf0"] * 2 + ["leaf1"] * 2 + ["leaf2"] * 2 + \
        ["leaf3"] * 2
    assert topo.leaves() == {"leaf0": ["gpu001", "gpu002"], "leaf1": ["gpu003", "gpu004"],
                             "leaf2": ["gpu005", "gpu006"], "leaf3": ["gpu007", "gpu008"]}
    core = next(s for s in topo.switches if s.name == "core")
    assert core.level == 2 and core.switches == ("agg0", "agg1") and len(core.nodes) == 8
    assert topo.leaf_of("gpu009") is None


def test_older_slurm_trailing_spaces_and_the_block_plugin_parse():
    old = "SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[1-2] \nSwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[3-4] \n"
    assert parse_topology(old).leaves() == {"s0": ["n1", "n2"], "s1": ["n3", "n4"]}
    block = "BlockName=b1 BlockIndex=0 Nodes=n[1-4]\nBlockName=b2 BlockIndex=1 Nodes=n[5-8]\nBlockSizes=4,8\n"
    topo = parse_topology(block)
    assert topo.kind == "block" and topo.unit == "block" and topo.leaf_of("n6") == "b2"


@pytest.mark.parametrize("text, told", [
    ("No topology information available\n", "not a SwitchName= or BlockName= record"),
    ("", "names no switch and no block"),
    ("SwitchName=s0 Level=x LinkSpeed=1 Nodes=n1\n", "Level='x'"),
    ("SwitchName=s0 Level=0 Nodes=n1\nBlockName=b1 BlockIndex=0 Nodes=n2\n", "mixes"),
    ("SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[1-\n", "bracket"),
])
def test_text_that_is_no_topology_is_refused_naming_why(text, told):
    with pytest.raises(TopologyError, match=None) as err:
        parse_topology(text)
    assert told in str(err.value)


# -- the best placement, against a brute force over every allocation of nodes to leaves -----------------------------

def megatron_groups(lay: ParallelLayout) -> dict[str, list[set[int]]]:
    """TP, CP and EP groups from Megatron-core's rank order written out (dense tp-cp-dp-pp, expert etp-ep-edp-pp),
    independently of hpc_tools.topology's strides."""
    t, c, d, p = lay.tensor_size, lay.context_size, lay.data_size, lay.pipeline_size
    e, et = lay.expert_size, lay.expert_tensor_size
    ed = lay.world_size // (p * et * e)
    dense = {(ti, ci, di, pi): ti + t * (ci + c * (di + d * pi))
             for ti, ci, di, pi in itertools.product(range(t), range(c), range(d), range(p))}
    expert = {(ti, ei, di, pi): ti + et * (ei + e * (di + ed * pi))
              for ti, ei, di, pi in itertools.product(range(et), range(e), range(ed), range(p))}

    def groups(table, axis):
        out: dict[tuple, set[int]] = {}
        for key, rank in table.items():
            out.setdefault(key[:axis] + key[axis + 1:], set()).add(rank)
        return list(out.values())

    return {"TP": groups(dense, 0) if t > 1 else [], "CP": groups(dense, 1) if c > 1 else [],
            "EP": groups(expert, 1) if e > 1 else []}


def brute_force(lay: ParallelLayout, sizes: list[int]) -> tuple[set[str], int]:
    """(kinds that must cross leaves, fewest leaves used), by trying every leaf for every node: the kinds kept are
    the best in priority order TP, then CP, then EP (lexicographically)."""
    groups = megatron_groups(lay)
    best: tuple | None = None
    for assign in itertools.product(range(len(sizes)), repeat=lay.nodes):
        if any(assign.count(i) > s for i, s in enumerate(sizes)):
            continue
        crossing = tuple(any(len({assign[r // lay.ranks_per_node] for r in g}) > 1 for g in groups[k])
                         for k in ("TP", "CP", "EP"))
        key = (crossing, len(set(assign)))
        best = key if best is None or key < best else best
    assert best is not None
    return {k for k, x in zip(("TP", "CP", "EP"), best[0]) if x}, best[1]


def layouts() -> list[tuple[ParallelLayout, list[int]]]:
    """Layouts over 2-6 nodes of 2, 4 or 8 ranks and leaves of 1-4 nodes: TP, CP, EP sizes that fill the world."""
    rng = random.Random(34)
    out = []
    for nodes, rpn in itertools.product((2, 3, 4, 6), (2, 4, 8)):
        world = nodes * rpn
        for _ in range(6):
            tp = rng.choice([d for d in (1, 2, 4, 8, 16) if world % d == 0])
            cp = rng.choice([d for d in (1, 2, 4) if world % (tp * d) == 0])
            etp = rng.choice([1, tp])
            ep = rng.choice([d for d in (1, 2, 4, 8, 16) if world % (etp * d) == 0])
            sizes = [rng.randint(1, 4) for _ in range(rng.randint(2, 3))]
            if sum(sizes) < nodes:
                sizes.append(nodes - sum(sizes))
            out.append((layout(nodes, rpn, tp, cp, ep, etp), sizes))
    return out


@pytest.mark.parametrize("lay, sizes", layouts(), ids=lambda x: x.describe().split(" on")[0] + f"@{x.nodes}x"
                         f"{x.ranks_per_node}" if isinstance(x, ParallelLayout) else "+".join(map(str, x)))
def test_the_placement_keeps_what_the_best_assignment_keeps(lay, sizes):
    crossing, fewest = brute_force(lay, sizes)
    best = placement(lay, sizes)
    assert {s.kind.name for s in best.must_cross()} == crossing
    assert best.short == 0 and sorted(best.kept) == sorted({"TP", "CP", "EP"} - crossing - {
        k for k, n in (("TP", lay.tensor_size), ("CP", lay.context_size), ("EP", lay.expert_size)) if n == 1})
    assert best.switches >= fewest  # packing largest leaves first may use more leaves, never fewer than possible
    for i, s in enumerate(sizes):
        assert best.assignment.count(i) <= s


def test_the_issue_example_two_switches_of_two_4_gpu_nodes():
    """TP8 must span two nodes (on one switch), EP16 must span both switches; --switches=2."""
    best = placement(layout(4, 4, tp=8, ep=16), [2, 2])
    spans = {s.kind.name: (s.nodes, s.leaves) for s in best.spans}
    assert spans["TP"] == (2, 1) and spans["EP"] == (4, 2)
    assert [s.kind.name for s in best.must_cross()] == ["EP"] and best.switches == 2
    assert placement(layout(4, 4, tp=8, ep=8), [2, 2]).must_cross() == []
    assert placement(layout(4, 4, tp=16), [2, 2]).must_cross()[0].kind.name == "TP"


# -- node order ---------------------------------------------------------------------------------------------------

def test_node_order_over_generated_allocations():
    """Any allocation of a two-level tree, in any Slurm order: the result is a permutation of the step's nodes,
    every TP group on one switch when a switch holds a TP block, each leaf's nodes in the allocation's order."""
    rng = random.Random(7)
    for _ in range(200):
        leaves = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        names = [[f"sw{i}n{j}" for j in range(n)] for i, n in enumerate(leaves)]
        text = "".join(f"SwitchName=sw{i} Level=0 LinkSpeed=1 Nodes={','.join(ns)}\n" for i, ns in enumerate(names))
        topo = parse_topology(text)
        alloc = [n for ns in names for n in ns]
        rng.shuffle(alloc)
        rpn = rng.choice([2, 4])
        tp = rng.choice([d for d in (1, 2, 4, 8) if (len(alloc) * rpn) % d == 0])
        lay = layout(len(alloc), rpn, tp=tp)
        order = node_order(alloc, topo, lay)
        assert order is not None and sorted(order) == sorted(alloc)
        for leaf, nodes in topo.leaves().items():
            assert [n for n in order if n in nodes] == [n for n in alloc if n in nodes]
        tp_nodes = max(tp // rpn, 1)
        if any(n >= tp_nodes for n in leaves) and all(n % tp_nodes == 0 for n in leaves):
            for g in range(0, len(order), tp_nodes):
                assert len({topo.leaf_of(n) for n in order[g:g + tp_nodes]}) == 1, (order, tp)


def test_node_order_of_an_interleaved_allocation_and_its_hostfile():
    topo = parse_topology(INTERLEAVED)
    order = node_order(["n1", "n2", "n3", "n4"], topo, layout(4, 4, tp=8))
    assert order == ["n1", "n3", "n2", "n4"]
    assert hostfile_lines(order, 2) == ["n1", "n1", "n3", "n3", "n2", "n2", "n4", "n4"]
    assert node_order(["n1", "n9"], topo, layout(2, 4)) is None  # a node the topology does not list


def test_the_job_step_names_a_group_the_allocation_splits(tmp_path):
    topo = parse_topology("SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n1\nSwitchName=s1 Level=0 LinkSpeed=1 Nodes=n2\n"
                          "SwitchName=s2 Level=0 LinkSpeed=1 Nodes=n[3-4]\n")
    exports, log = plan(tmp_path, ["n1", "n2", "n3", "n4"], layout(4, 4, tp=8), topo)
    assert log[0].endswith("ranks in topology order (leaf switches): s2: n3,n4 | s0: n1 | s1: n2"), log
    assert log[1:] == ["hpc_tools: placement: a TP8 group spans 2 leaf switches in this allocation"], log
    assert (tmp_path / "hostfile").read_text().split() == ["n3"] * 4 + ["n4"] * 4 + ["n1"] * 4 + ["n2"] * 4
    assert exports[0] == f"HPC_TOOLS_HOSTFILE={tmp_path / 'hostfile'}" and exports[1] == "export MASTER_ADDR=n3"
    exports, log = plan(tmp_path, ["n1", "n2"], layout(2, 4, tp=8), "no Slurm here")
    assert exports == [] and "ranks in Slurm's order: no Slurm here" in log[0]


# -- validate -----------------------------------------------------------------------------------------------------

def write_recipe(tmp_path: Path, **cluster) -> Path:
    import yaml

    raw = small_recipe(**cluster)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def validate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HPC_TOOLS_SITE": "none", "HPC_TOOLS_SLURM": "off"}
    return subprocess.run([sys.executable, "-m", "hpc_tools", "validate", "--offline", "--no-fit", *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def test_validate_warns_when_a_group_must_span_switches_and_exits_0(tmp_path):
    topo = tmp_path / "topo.txt"
    topo.write_text(TWO_SWITCHES)
    recipe = write_recipe(tmp_path, nodes=4, gpus_per_node=4, switches=1, gpu_type="H100-SXM")
    out = validate(str(recipe), "--topology", str(topo), "--set", "backend.kind=megatron",
                   "--set", "parallel.tensor_size=16",
                   "--set", "parallel.pipeline_size=1", "--set", "model.num_attention_heads=16")
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("warning:")]
    assert any("TP16 groups must span 2 leaf switches" in ln and re.search(
               r"all-reduce at the inter-node busbw \d+ GB/s per GPU: [\d.e+-]+ s of a [\d.e+-]+ s step, more where "
               "the switch uplinks are oversubscribed", ln)
               and "parallel.tensor_size of at most 8" in ln for ln in lines), out.stderr
    assert any("cluster.switches=1 is fewer leaf switches" in ln and "set cluster.switches=2" in ln
               for ln in lines), out.stderr
    fits = validate(str(recipe), "--topology", str(topo), "--set", "cluster.switches=2", "-v")
    assert fits.returncode == 0 and "warning:" not in fits.stderr, fits.stderr
    assert "topology (tree, 2 leaf switches): at best" in fits.stderr


@pytest.mark.slurm_client
def test_validate_reads_the_live_topology_when_slurm_answers(tmp_path):
    """No --topology: a Slurm that answers sinfo is asked `scontrol show topology` (stand-ins on PATH)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "topology.txt").write_text(TWO_SWITCHES)
    (tmp_path / "sinfo.txt").write_text("".join(f"gpu*|up|infinite|1-infinite|gpu:h100:4|64|n{i}\n"
                                                for i in range(1, 5)))
    for name, body in (("sinfo", f"exec cat {tmp_path / 'sinfo.txt'}"),
                       ("scontrol", f'[ "$1 $2" = "show topology" ] && exec cat {tmp_path / "topology.txt"}')):
        (bindir / name).write_text(f"#!/bin/sh\n{body}\nexit 1\n")
        (bindir / name).chmod(0o755)
    recipe = write_recipe(tmp_path, nodes=4, gpus_per_node=4, gpu_type="H100-SXM", partition="gpu")
    env = {**os.environ, "HPC_TOOLS_SITE": "none", "PATH": f"{bindir}:{os.environ['PATH']}"}
    env.pop("HPC_TOOLS_SLURM", None)
    args = ["--no-fit", "--set", "backend.kind=megatron", "--set", "parallel.tensor_size=16", "--set",
            "parallel.pipeline_size=1", "--set", "model.num_attention_heads=16", "--set", "cluster.python=python3"]
    out = subprocess.run([sys.executable, "-m", "hpc_tools", "validate", str(recipe), *args], capture_output=True,
                         text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "warning: " in out.stderr and "TP16 groups must span 2 leaf switches" in out.stderr, out.stderr
    (tmp_path / "topology.txt").write_text("No topology information available\n")
    out = subprocess.run([sys.executable, "-m", "hpc_tools", "validate", str(recipe), *args, "-v"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0 and "warning:" not in out.stderr, out.stderr
    assert "note: topology not checked: line 1 of the topology is not a SwitchName= or BlockName= record" in \
        out.stderr, out.stderr


def test_validate_refuses_a_topology_file_that_is_none_in_one_line(tmp_path):
    topo = tmp_path / "topo.txt"
    topo.write_text("No topology information available\n")
    out = validate(str(write_recipe(tmp_path)), "--topology", str(topo))
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "--topology" in out.stderr and "Traceback" not in out.stderr


# -- the rendered script ----------------------------------------------------------------------------------------------

def test_the_rendered_script_asks_for_switches_only_when_told(tmp_path):
    plain = render_sbatch(resolve(small_recipe(nodes=4, gpus_per_node=4)))
    assert "--switches" not in plain and "hpc_tools.job.placement" not in plain
    script = render_sbatch(resolve(small_recipe(nodes=4, gpus_per_node=4, switches=2, switch_wait_min=30,
                                                place_by_topology=True)))
    assert "#SBATCH --switches=2@30\n" in script
    assert 'srun --kill-on-bad-exit=1' in script and '"${HPC_TOOLS_PLACE[@]}" --label' in script
    assert script.count("-m hpc_tools.job.placement") == 1


def run_placement_lines(script: str, tmp_path: Path, topology: str, env: dict[str, str]) -> list[str]:
    """The script's placement lines (after its 'PLACEMENT above' comment) and its rank step's srun line, run in bash
    with a stand-in scontrol printing ``topology`` and a stand-in srun printing the hostfile it was given and its
    options up to --label; then whether SLURM_HOSTFILE leaks to the script's later steps, and MASTER_ADDR."""
    lines = script.splitlines()
    start = next(i for i, ln in enumerate(lines) if "(PLACEMENT above)" in ln)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == 'eval "$HPC_TOOLS_PLACED"')
    [rank_step] = [ln.strip() for ln in lines if "-m hpc_tools.runtime.rank" in ln]
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (tmp_path / "topology.txt").write_text(topology)
    for name, body in (("scontrol", f'[ "$1 $2" = "show topology" ] && exec cat {tmp_path / "topology.txt"}\nexit 1'),
                       ("srun", 'echo "HOSTFILE=$(tr "\\n" " " < "${SLURM_HOSTFILE:-/dev/null}")"\n'
                                'args=(); for a in "$@"; do [ "$a" = --label ] && break; args+=("$a"); done\n'
                                'echo "ARGS=${args[*]}"')):
        (bindir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bindir / name).chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    body = "\n".join(ln.strip() for ln in lines[start + 1:end + 1])
    probe = (f"set -euo pipefail\nRUN_DIR={run_dir}\nMASTER_ADDR=first\n{body}\n{rank_step}\n"
             'echo "LATER=${SLURM_HOSTFILE:-unset}"\necho "MASTER_ADDR=$MASTER_ADDR"\n')
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines() + ["STDERR " + out.stderr]


def test_the_rendered_placement_orders_the_nodes_by_switch(tmp_path):
    """A two-switch topology whose leaves interleave in Slurm's node order: the rendered lines give srun a
    hostfile that keeps each TP8 group (two 4-GPU nodes) under one switch, rank 0's node as the rendezvous."""
    recipe = resolve(small_recipe(nodes=4, gpus_per_node=4, place_by_topology=True, switches=2),
                     TP8)
    out = run_placement_lines(render_sbatch(recipe), tmp_path, INTERLEAVED, {"SLURM_JOB_NODELIST": "n[1-4]"})
    assert out[0].split("=", 1)[1].split() == ["n1"] * 4 + ["n3"] * 4 + ["n2"] * 4 + ["n4"] * 4
    assert out[1] == "ARGS=--kill-on-bad-exit=1 --cpus-per-task=8 --mem=0 --distribution=arbitrary --ntasks=16"
    assert out[2:4] == ["LATER=unset", "MASTER_ADDR=n1"]
    assert "ranks in topology order (leaf switches): s0: n1,n3 | s1: n2,n4" in out[4]


def test_the_rendered_placement_keeps_slurms_order_without_a_topology(tmp_path):
    recipe = resolve(small_recipe(nodes=2, gpus_per_node=4, place_by_topology=True, restarts=1, spare_nodes=1))
    out = run_placement_lines(render_sbatch(recipe), tmp_path, "No topology information available\n",
                              {"SLURM_JOB_NODELIST": "n[1-3]", "HPC_TOOLS_NODELIST": "n1,n3"})
    assert out[0] == "HOSTFILE=" and out[2:4] == ["LATER=unset", "MASTER_ADDR=first"]
    assert out[1] == "ARGS=--kill-on-bad-exit=1 --cpus-per-task=8 --mem=0 --overlap --nodelist=n1,n3 --nodes=2 " \
        "--ntasks=8"
    assert "ranks in Slurm's order" in out[4]


def test_the_rendered_placement_follows_the_restart_controllers_nodes(tmp_path):
    recipe = resolve(small_recipe(nodes=2, gpus_per_node=4, place_by_topology=True, restarts=1, spare_nodes=1),
                     TP8)
    out = run_placement_lines(render_sbatch(recipe), tmp_path, TWO_SWITCHES,
                              {"SLURM_JOB_NODELIST": "n[1-4]", "HPC_TOOLS_NODELIST": "n1,n3,n4"})
    assert out[0].split("=", 1)[1].split() == ["n3"] * 4 + ["n4"] * 4 and out[3] == "MASTER_ADDR=n3"
    assert out[1].endswith("--overlap --distribution=arbitrary --ntasks=8")
