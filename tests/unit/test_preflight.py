"""Preflight's logic without ranks (hpc_tools.runtime.preflight.bisect and .verdict): the search over halves within
ceil(log2 N) + 1 rounds for every N from 2 to 64 and every slow node, the per-node verdicts over generated figures,
the bus-bandwidth formulas, the transport parsers, the one-line failure and the recipe fields. The checks on real
ranks are tests/integration/test_preflight_local.py."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hpc_tools.runtime.preflight.bisect import find_slow, max_rounds
from hpc_tools.runtime.preflight.verdict import (
    OK,
    SLOW,
    SLOW_FACTOR,
    TRANSPORT,
    RankResult,
    Report,
    busbw_gbps,
    expected_transport,
    failure_line,
    judge,
    named,
    nccl_transport,
    read_report,
    rows_from_dict,
    table_lines,
    transport_reasons,
)


def simulated(bad: str | None, measurable_alone: bool = True):
    """A cost function: a group is slow when it holds ``bad``; with ``measurable_alone=False`` a group of one node
    cannot be told (None), as on ranks where one node has no link of its own to test."""
    calls = []

    def slow(groups):
        calls.append(groups)
        return [None if len(g) == 1 and not measurable_alone else bad in g for g in groups]

    return slow, calls


def test_rounds_bound_formula():
    assert [max_rounds(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 3, 3, 4, 4, 5, 7]


@pytest.mark.parametrize("n", range(2, 65))
def test_search_finds_every_slow_node_within_the_bound(n):
    nodes = [f"n{i:02d}" for i in range(n)]
    bound = math.ceil(math.log2(n)) + 1
    for bad in nodes:
        for alone in (True, False):
            slow, calls = simulated(bad, alone)
            found = find_slow(nodes, slow)
            assert found.rounds == len(calls) <= bound, (n, bad, found)
            if n == 2 and not alone:  # neither end of a 2-node link can be tested apart: both are named
                assert set(found.culprits) == set(nodes), found
            else:
                assert found.culprits == (bad,), (n, bad, found)
            for groups in calls:  # the groups of a round are disjoint (they run at once)
                flat = [x for g in groups for x in g]
                assert len(flat) == len(set(flat))
            if n >= 4:  # from 4 nodes on, every group tested has a link to test (a lone half gets a healthy node)
                assert all(len(g) > 1 for rnd in calls for g in rnd), calls


@pytest.mark.parametrize("n", [2, 3, 7, 16, 64])
def test_search_over_healthy_nodes_stops_after_one_round(n):
    slow, calls = simulated(None)
    found = find_slow([f"n{i}" for i in range(n)], slow)
    assert found.culprits == () and found.rounds == 1 and len(calls) == 1


@pytest.mark.parametrize("n", [2, 3])
def test_search_names_nothing_when_nothing_says_a_pair_is_slow(n):
    def slow(groups):  # no expected figure for the whole; lone nodes cannot be told apart
        return [None if len(groups) == 1 or len(g) == 1 else False for g in groups]

    found = find_slow([f"n{i}" for i in range(n)], slow)
    assert found.culprits == () and found.rounds <= max_rounds(n)


def test_search_when_the_whole_is_unknown_and_no_half_is_slow():
    def slow(groups):
        return [None if len(groups) == 1 else False for _ in groups]

    found = find_slow(["a", "b", "c", "d"], slow)
    assert found.culprits == () and found.between is None and found.rounds == 2


def test_search_names_the_halves_when_the_slow_part_lies_between_them():
    def slow(groups):  # the whole is slow, each half on its own is not: an uplink between them
        return [len(groups) == 1 for _ in groups]

    found = find_slow(["a", "b", "c", "d"], slow)
    assert found.culprits == () and found.between == (("a", "b"), ("c", "d"))


def test_search_two_slow_nodes_stops_naming_the_candidates():
    def slow(groups):
        return [bool({"n1", "n6"} & set(g)) for g in groups]

    found = find_slow([f"n{i}" for i in range(8)], slow)
    assert set(found.culprits) == {f"n{i}" for i in range(8)} and "more than one" in found.note


def test_search_rejects_a_cost_function_that_answers_the_wrong_count():
    with pytest.raises(ValueError, match="2 groups"):
        find_slow(["a", "b", "c"], lambda groups: [True])


# --- verdicts over generated figures ----------------------------------------------------------------------------------
def _ranks(gemm: list[float], mem: list[float] | None = None, per_node: int = 1) -> list[RankResult]:
    mem = mem or [100.0] * len(gemm)
    return [RankResult(rank=i, node=f"n{i // per_node}", gemm_tflops=g, mem_gbps=m, transport="gloo:eth0 10.0.0.1")
            for i, (g, m) in enumerate(zip(gemm, mem))]


@pytest.mark.parametrize("seed", range(40))
def test_a_node_at_half_the_median_is_named_and_nodes_within_0_9x_are_not(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 24)
    base = rng.uniform(0.001, 1000.0)
    gemm = [base * rng.uniform(0.9, 1.0) for _ in range(n)]
    rows = judge(_ranks(gemm))
    assert named(rows) == [], [r.reasons for r in rows]
    bad = rng.randrange(n)
    gemm[bad] = base * 0.5
    mem = [rng.uniform(90, 100) for _ in range(n)]
    rows = judge(_ranks(gemm, mem))
    assert [r.node for r in named(rows)] == [f"n{bad}"]
    row = named(rows)[0]
    assert row.verdict == SLOW and "GEMM" in row.reasons[0] and f"{base * 0.5:.3g}" in row.reasons[0]
    assert f"below {SLOW_FACTOR}x" in row.reasons[0]


@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.34, 0.36, 0.5, 0.69])
def test_two_nodes_are_compared_with_each_other_only_across_a_large_gap(ratio):
    """Which of two is abnormal their median (their mean) cannot tell from a small gap: a loaded host measured two
    healthy nodes 2x apart. Two nodes: the slower is named below TWO_NODE_FACTOR x the other (GEMM and memory alike),
    and the hardware peak still judges; three are judged against their median again."""
    from hpc_tools.runtime.preflight.verdict import MIN_NODES_FOR_MEDIAN, PEAK_FLOOR, TWO_NODE_FACTOR

    assert MIN_NODES_FOR_MEDIAN == 3 and TWO_NODE_FACTOR == 0.35
    for order in (1, -1):  # the slow node first or second
        gemm, mem = [10.0 * ratio, 10.0][::order], [100.0 * ratio, 100.0][::order]
        slow = "n0" if order == 1 else "n1"
        rows = judge(_ranks(gemm, mem))
        if ratio < TWO_NODE_FACTOR:
            [row] = named(rows)
            assert row.node == slow and len(row.reasons) == 2 and "the other node's" in row.reasons[0]
            assert f"below {TWO_NODE_FACTOR}x" in row.reasons[0] and row.reasons[1].startswith("memory bandwidth")
        else:
            assert named(rows) == []
        peak = 10.0 / PEAK_FLOOR * 0.99  # the healthy node just above the floor, the other below it
        assert [r.node for r in named(judge(_ranks(gemm), peak_tflops=peak))] == [slow]
    assert [r.node for r in named(judge(_ranks([10.0 * ratio, 10.0, 10.0])))] == ["n0"]


@pytest.mark.parametrize("seed", range(20))
def test_memory_bandwidth_and_the_slowest_rank_of_a_node(seed):
    rng = random.Random(seed)
    nodes, per = rng.randint(3, 8), rng.randint(1, 4)
    mem = [rng.uniform(95, 100) for _ in range(nodes * per)]
    slow_rank = rng.randrange(nodes * per)
    mem[slow_rank] = 40.0  # one rank of a node: the node's figure is its slowest rank's
    rows = judge(_ranks([10.0] * (nodes * per), mem, per_node=per))
    assert [r.node for r in named(rows)] == [f"n{slow_rank // per}"]
    assert named(rows)[0].mem_gbps == 40.0 and "memory bandwidth 40" in named(rows)[0].reasons[0]


def test_peak_floor_names_a_node_far_below_the_hardware_table_even_when_all_are():
    rows = judge(_ranks([100.0, 101.0, 99.0]), peak_tflops=989.4)
    assert len(named(rows)) == 3 and "hardware peak 989.4" in rows[0].reasons[0]
    assert named(judge(_ranks([700.0, 710.0, 690.0]), peak_tflops=989.4)) == []


def test_failed_rank_and_transport_verdicts_and_the_one_line():
    ranks = _ranks([10.0, 10.0, 10.0])
    ranks[1].error = "GLOO_SOCKET_IFNAME=eth9 names no interface with an IPv4 address on this node"
    rows = judge(ranks, transport_why={"n2": "gloo uses interface eth1, not eth0 like the others"},
                 link_reasons={"n2": "slow link"})
    assert [(r.node, r.verdict) for r in rows] == [("n0", OK), ("n1", "failed"), ("n2", TRANSPORT)]
    line = failure_line(rows, ["all-reduce busbw over all 3 ranks 1 GB/s is 0.02x the expected 45 GB/s"], "strict")
    assert "\n" not in line and line.startswith("preflight (cluster.preflight=strict): node n1 failed: rank 1 failed")
    assert "node n2 transport: slow link; gloo uses interface eth1" in line and "0.02x the expected" in line


def test_table_and_json_round_trip(tmp_path):
    rows = judge(_ranks([10.0, 4.0, 10.0]), busbw={"n0": 1.5, "n1": 1.4, "n2": 1.5})
    lines = table_lines(rows)
    assert lines[0].split()[:3] == ["node", "ranks", "GEMM"] and len(lines) == 4
    assert "slow (GEMM 4 TFLOP/s is 0.40x" in lines[2]
    report = Report(mode="auto", budget_s=60, seconds=3.2, rows=rows)
    report.write(tmp_path)
    data = read_report(tmp_path)
    assert data["healthy"] is False and data["named"] == ["n1"] and data["thresholds"]["slow_factor"] == SLOW_FACTOR
    assert [r.node for r in rows_from_dict(data)] == ["n0", "n1", "n2"]
    assert read_report(tmp_path / "missing") is None


@pytest.mark.parametrize(("op", "factor"), [("all_reduce", lambda n: 2 * (n - 1) / n),
                                            ("all_gather", lambda n: (n - 1) / n),
                                            ("all_to_all", lambda n: (n - 1) / n)])
def test_busbw_follows_nccl_tests(op, factor):
    for n, nbytes, secs in itertools.product((2, 3, 8, 64), (1 << 20, 3e9), (1e-3, 2.0)):
        assert busbw_gbps(op, nbytes, secs, n) == pytest.approx(nbytes / secs / 1e9 * factor(n))
    assert busbw_gbps(op, 1 << 20, 1.0, 1) is None and busbw_gbps(op, 1 << 20, 0.0, 4) is None


NCCL_IB = """node1:123:456 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.1<0>
node1:123:456 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA"""
NCCL_ROCE = "x NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE ; OOB eth0:10.0.0.1<0>\nx via NET/IB/0"
NCCL_SOCKET = """node1:1:2 [0] NCCL INFO NET/IB : No device found.
node1:1:2 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>
node1:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0"""


# NCCL 2.28.9's own lines on a lent H200 without InfiniBand (one rank; the preflight's NCCL_DEBUG_FILE)
NCCL_H200 = """vm:537:537 [0] NCCL INFO NET/IB : No device found.
vm:537:537 [0] NCCL INFO NET/IB : Using [RO]; OOB eth0:192.0.2.2<0>
vm:537:537 [0] NCCL INFO Failed to initialize NET plugin IB
vm:537:537 [0] NCCL INFO NET/Socket : Using [0]eth0:192.0.2.2<0>
vm:537:537 [0] NCCL INFO Initialized NET plugin Socket
vm:537:537 [0] NCCL INFO Assigned NET plugin Socket to comm
vm:537:537 [0] NCCL INFO Using network Socket"""


def test_nccl_transport_from_its_init_lines():
    assert nccl_transport(NCCL_IB) == "NET/IB"
    assert nccl_transport(NCCL_ROCE) == "NET/IB/RoCE"
    assert nccl_transport(NCCL_SOCKET) == "NET/Socket"
    assert nccl_transport(NCCL_H200) == "NET/Socket"  # IB announced, failed, Socket used
    assert nccl_transport("x NCCL INFO Using network IB") == "NET/IB"
    assert nccl_transport("NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>") is None  # devices alone decide nothing
    assert nccl_transport("NCCL INFO Bootstrap : Using eth0") is None


def test_transport_expectations_and_reasons():
    assert expected_transport(True, {}, True)[0] == "NET/IB"
    assert expected_transport(True, {"NCCL_IB_DISABLE": "1"}, True)[0] == "NET/Socket"
    assert expected_transport(True, {}, False)[0] is None
    assert expected_transport(False, {"GLOO_SOCKET_IFNAME": "ib0,eth0"}, True)[0] == "ib0"
    why = transport_reasons({"a": "NET/IB", "b": "NET/Socket", "c": "NET/IB/RoCE"}, "NET/IB", True)
    assert list(why) == ["b"] and "fell back to TCP" in why["b"]
    gloo = {"a": "gloo:eth0 10.0.0.1", "b": "gloo:eth0 10.0.0.2", "c": "gloo:eth1 10.1.0.3"}
    assert list(transport_reasons(gloo, None, False)) == ["c"]  # the majority's interface is expected
    assert set(transport_reasons(gloo, "eth1", False)) == {"a", "b"}
    loop = {"a": "gloo:lo 127.0.0.1", "b": "gloo:lo 127.0.0.1"}
    assert transport_reasons(loop, None, False, {"a": "h1", "b": "h1"}) == {}
    assert set(transport_reasons(loop, None, False, {"a": "h1", "b": "h2"})) == {"a", "b"}


def small_recipe(**cluster) -> dict:
    return {"name": "preflight", "backend": {"kind": "comm_check"},
            "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                      "vocab_size": 512}, "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu", **cluster}}


def test_recipe_fields_and_when_preflight_runs():
    from hpc_tools.recipe.load import resolve
    from hpc_tools.runtime.preflight.run import enabled

    def on(**cluster):
        return enabled(resolve(small_recipe(**cluster)))

    assert resolve(small_recipe()).cluster.preflight == "auto"
    assert resolve(small_recipe()).cluster.preflight_budget_s == 60
    assert on(nodes=2) and not on(nodes=1) and on(nodes=1, preflight="strict") and not on(nodes=4, preflight="off")


@pytest.mark.parametrize(("field", "value", "words"), [
    ("preflight", "sometimes", "auto"), ("preflight", True, "auto"), ("preflight_budget_s", 0, "greater than 0"),
    ("preflight_budget_s", 1.5, "integer"), ("preflight_budget_s", 3601, "less than or equal")])
def test_bad_preflight_fields_are_one_line(field, value, words):
    from hpc_tools.errors import RecipeError
    from hpc_tools.recipe.load import resolve

    with pytest.raises(RecipeError) as err:
        resolve(small_recipe(**{field: value}))
    assert len(err.value.violations) == 1
    message = str(err.value.violations[0])
    assert "\n" not in message and f"cluster.{field}" in message and words in message, message


@pytest.mark.parametrize("args", [["missing.yaml"],
                                  ["recipes/comm_check.yaml", "--set", "cluster.preflight_budget_s=0"],
                                  ["recipes/comm_check.yaml", "--set", "cluster.preflight=maybe"]])
def test_the_command_refuses_bad_input_in_one_line(tmp_path, args):
    from tests.helpers import run_cli

    out = run_cli("preflight", *args, "--runs-dir", str(tmp_path / "runs"), timeout=120)
    assert out.returncode == 2 and out.stdout == "", out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_planners_expected_busbw_reaches_the_ranks_through_the_manifest():
    from types import SimpleNamespace

    from hpc_tools.planner.hardware import GPUS
    from hpc_tools.recipe.load import resolve
    from hpc_tools.runtime.preflight.run import expected_busbw
    from hpc_tools.submission import preflight_expectation

    gpu = resolve(small_recipe(nodes=2, gpus_per_node=8, gpu_type="H100-SXM"))
    recorded = preflight_expectation(gpu)
    assert recorded == {"inter": GPUS["H100-SXM"].inter_node_bw_gbps, "intra": GPUS["H100-SXM"].intra_node_bw_gbps,
                        "source": "planner/hardware.py"}
    assert preflight_expectation(resolve(small_recipe())) is None  # CPU ranks
    assert preflight_expectation(resolve(small_recipe(gpu_type="XPU-9000"))) is None  # not in the table
    over = preflight_expectation(resolve(small_recipe(gpu_type="H100-SXM", inter_node_bw_gbps=12.5)))
    assert over["inter"] == 12.5 and over["source"] == "the recipe"

    def ctx(recipe, manifest):
        return SimpleNamespace(recipe=recipe, run=SimpleNamespace(manifest=lambda: manifest))

    assert expected_busbw(ctx(gpu, {"preflight_expected_busbw_gbps": recorded}))[:2] == (45.0, 360.0)
    plain = resolve(small_recipe(nodes=2, gpu_type="H100-SXM", inter_node_bw_gbps=20.0))
    assert expected_busbw(ctx(plain, {}))[:2] == (20.0, None)  # a plain sbatch: the recipe's overrides only
    assert expected_busbw(ctx(gpu, {}))[:2] == (None, None)


def test_ranks_that_never_reach_the_rendezvous_are_named_within_the_budget():
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from hpc_tools.runtime.distenv import free_port
    from hpc_tools.runtime.preflight.run import _endpoints_agree

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 3, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    ctx = SimpleNamespace(rank=0, dist=SimpleNamespace(world_size=3, master_addr="127.0.0.1", master_port=port),
                          recipe=SimpleNamespace(cluster=SimpleNamespace(setup=SimpleNamespace(env={}))))
    store.set("preflight/endpoint/2", '["n2", "h2", "gloo:eth0 10.0.0.3", null]')  # rank 2 came, rank 1 did not
    t0 = time.monotonic()
    line = _endpoints_agree(ctx, store, RankResult(0, "n0", "h0", transport="gloo:eth0 10.0.0.1"), "strict", 1)
    assert time.monotonic() - t0 < 10
    assert line.startswith("preflight (cluster.preflight=strict): rank(s) 1 did not reach the rendezvous within 1 s")
    store.set("preflight/endpoint/1", '["n1", "h1", "gloo:eth1 10.1.0.2", null]')  # now all: n1's interface differs
    line = _endpoints_agree(ctx, store, RankResult(0, "n0", "h0", transport="gloo:eth0 10.0.0.1"), "strict", 1)
    assert line.startswith("preflight (cluster.preflight=strict): node n1 transport: gloo uses interface eth1, not "
                           "eth0"), line


class _SimulatedRunner:
    """The rank side's round function with its collective replaced: a group's busbw is 1.0, or 0.2 when it holds
    the bad node or both ends of the bad link; a figure over three nodes is off by a factor (rank counts differ)."""

    def __new__(cls, bad_node=None, bad_link=(), whole_factor=1.0):
        from hpc_tools.runtime.preflight.links import RoundRunner as _RoundRunner

        class Runner(_RoundRunner):
            def measure(self, measured):
                self.rounds_measured.append(list(measured))
                figs = {g: (0.2 if bad_node in g or (bad_link and set(bad_link) <= set(g)) else 1.0) for g in measured}
                self.figures.update({frozenset(g): v for g, v in figs.items()})
                return figs

        runner = Runner(None, {}, 0, None, None, {}, None, {})
        runner.rounds_measured = []
        return runner


@pytest.mark.parametrize("bad", [None, "a", "b", "c"])
@pytest.mark.parametrize("whole", [0.1, 1.0, 3.0])
def test_three_nodes_without_an_expected_figure_are_judged_from_their_pairs(bad, whole):
    """Three candidates split into a pair and a lone node with no healthy reference: every pair is measured and the
    slow node named, whatever the figure over all three was (it is over three ranks, not comparable with a pair's)."""
    runner = _SimulatedRunner(bad)
    runner.figures[frozenset("abc")] = whole
    found = find_slow(["a", "b", "c"], runner)
    assert found.culprits == ((bad,) if bad else ()), found
    assert found.rounds <= max_rounds(3)
    assert all(len(g) == 2 for rnd in runner.rounds_measured for g in rnd)  # pairs only, never three against two


def test_a_slow_link_among_three_nodes_names_both_of_its_ends():
    runner = _SimulatedRunner(bad_link=("a", "c"))
    runner.figures[frozenset("abc")] = 0.2  # measured before the search; no expected figure to judge it by
    found = find_slow(["a", "b", "c"], runner)
    assert {"a", "c"} <= set(found.culprits), found


class _Nvml:
    """pynvml's surface that ``measure.nvml_findings`` reads, with the answers a test sets (a GPU is needed for the
    real one; the driver's codes are nvml.h's). ``unsupported``: queries that raise as NVML's NotSupported does."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 0

    def __init__(self, ecc=0, rows=(0, 0, 0, 0), pending=0, reasons=0, unsupported=()):
        self.answers = {"ecc": ecc, "rows": rows, "pending": pending, "reasons": reasons}
        self.unsupported, self.calls = set(unsupported), []

    def _answer(self, name):
        self.calls.append(name)
        if name in self.unsupported:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.answers[name]

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        assert uuid.startswith("GPU-")
        return uuid

    def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter):
        assert (kind, counter) == (1, 0)  # uncorrected, volatile
        return self._answer("ecc")

    def nvmlDeviceGetRemappedRows(self, handle):
        return self._answer("rows")

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle):
        return self._answer("pending")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._answer("reasons")


@pytest.fixture
def cuda_device(monkeypatch):
    """A CUDA device as nvml_findings sees it: its UUID from torch's device properties."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="1234-abcd"))
    return types.SimpleNamespace(type="cuda", index=0)


@pytest.mark.parametrize("answers, kinds, words", [
    ({}, [], []),
    ({"reasons": 0x1 | 0x4}, [], []),  # idle and software power cap: not faults
    ({"ecc": 3}, ["failed"], ["3 uncorrected ECC"]),
    ({"rows": (0, 2, 1, 0)}, ["failed"], ["pending a GPU reset", "2 row(s)"]),
    ({"rows": (0, 0, 0, 1)}, ["failed"], ["remapping failed"]),
    ({"pending": 1}, ["failed"], ["retired memory pages"]),
    ({"reasons": 0x40 | 0x8}, ["slow"], ["hardware slowdown", "hardware thermal slowdown"]),
    ({"ecc": 1, "reasons": 0x80}, ["failed", "slow"], ["ECC", "power brake"]),
])
def test_nvml_findings_name_what_the_driver_counts(cuda_device, answers, kinds, words):
    from hpc_tools.runtime.preflight.measure import nvml_findings

    nvml = _Nvml(**answers)
    found = nvml_findings(cuda_device, nvml)
    assert [k for k, _ in found] == kinds, found
    text = " ".join(r for _, r in found)
    assert all(w in text for w in words), found
    assert nvml.calls[0] == "init" and nvml.calls[-1] == "shutdown"


def test_nvml_queries_a_gpu_lacks_are_skipped_and_a_cpu_rank_asks_nothing(cuda_device):
    import types

    from hpc_tools.runtime.preflight.measure import nvml_findings

    nvml = _Nvml(ecc=2, unsupported={"rows", "pending", "reasons"})
    assert [k for k, _ in nvml_findings(cuda_device, nvml)] == ["failed"]
    untouched = _Nvml(ecc=5)
    assert nvml_findings(types.SimpleNamespace(type="cpu", index=None), untouched) == [] and untouched.calls == []


def test_a_gpu_the_driver_reports_is_named_in_the_table():
    from hpc_tools.runtime.preflight.verdict import RankResult, failure_line, judge

    ecc = "3 uncorrected ECC error(s) since the driver loaded (NVML volatile count)"
    ranks = [RankResult(rank=0, node="g1", gemm_tflops=700.0),
             RankResult(rank=1, node="g2", gemm_tflops=710.0, health=[("failed", ecc)])]
    rows = judge(ranks)
    assert [r.verdict for r in rows] == ["ok", "failed"]
    line = failure_line(rows, [], "strict")
    assert line == f"preflight (cluster.preflight=strict): node g2 failed: rank 1 GPU: {ecc}"
