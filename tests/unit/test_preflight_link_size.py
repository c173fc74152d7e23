"""Preflight's slow-link search on GPUs (issue 46 item 4): it timed the layout's own message (1 MiB for comm_check)
with a host synchronize per run and judged it against 0.7 x the planner's large-message figure (45 GB/s between
H100 nodes): a healthy pair of nodes measures a fraction of that at 1 MiB, so on two nodes both were named and
``strict`` stopped a healthy job. Now the search's message is at least ``LINK_BYTES`` (64 MiB on GPUs), GPU runs are
timed several per synchronize, and a group is judged against the busbw expected at the message's size."""

from __future__ import annotations

import pytest

from hpc_tools.recipe.load import resolve
from hpc_tools.runtime.preflight import links, measure, run
from hpc_tools.runtime.preflight.bisect import find_slow
from tests.unit.test_preflight import small_recipe

H100_INTER = 45.0  # planner/hardware.py's inter-node busbw for H100 (GB/s)
NODES = {"n1": list(range(8)), "n2": list(range(8, 16))}


def test_the_link_message_on_gpus_is_tens_of_mib_and_the_layouts_on_cpu():
    comm_check = resolve(small_recipe(nodes=2, gpus_per_node=8, gpu_type="H100-SXM"))
    layout = run.message_bytes(comm_check, "cuda")
    assert layout == 1 << 20  # a small model's activations: the lower bound
    assert run.link_bytes(layout, "cuda") >= 32 << 20
    assert run.link_bytes(run.message_bytes(comm_check, "cpu"), "cpu") == run.message_bytes(comm_check, "cpu")


def test_the_expected_busbw_falls_with_the_message_size_and_nears_the_links_figure_for_large_ones():
    sizes = [1 << 20, 8 << 20, 64 << 20, 1 << 30]
    at = [run.expected_at(H100_INTER, s, 16) for s in sizes]
    assert at == sorted(at) and at[-1] < H100_INTER
    assert at[0] < 0.3 * H100_INTER, "a 1 MiB all-reduce across nodes is latency-bound"
    assert at[2] > 0.85 * H100_INTER and at[3] > 0.98 * H100_INTER
    assert run.expected_at(None, 1 << 20, 16) is None and run.expected_at(H100_INTER, 1 << 20, 1) == H100_INTER


class _Measured(links.RoundRunner):
    """The search's round function with its collective replaced by a figure: ``share`` of the busbw expected at the
    runner's message size over the group's ranks (healthy links measure near it)."""

    def __init__(self, nbytes: int, share: float):
        super().__init__(None, NODES, nbytes, None, None, {}, H100_INTER, {})
        self.share = share

    def measure(self, measured):
        figs = {g: self.share * run.expected_at(H100_INTER, self.nbytes, 8 * len(g)) for g in measured}
        self.figures.update({frozenset(g): v for g, v in figs.items()})
        return figs


@pytest.mark.parametrize("nbytes", [1 << 20, 64 << 20])
def test_two_healthy_nodes_are_not_named_at_any_message_size(nbytes):
    search = find_slow(list(NODES), _Measured(nbytes, share=0.8))
    assert search.culprits == (), search.note


def test_a_slow_pair_of_nodes_is_still_named():
    search = find_slow(list(NODES), _Measured(64 << 20, share=0.3))
    assert search.culprits == ("n1", "n2"), search.note


def test_gpu_runs_are_timed_several_per_synchronize(tmp_path, monkeypatch):
    """One gloo rank stands for the group; what is counted is the real function's collectives and synchronizes."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ops, syncs = [], []
        real = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: ops.append(1) or real(*a, **k))
        monkeypatch.setattr(measure, "_sync", lambda device: syncs.append(1))
        seconds = measure.collective_seconds("all_reduce", 1 << 16, None, 1, torch.device("cpu"), 0, iters=3,
                                             per_sync=run.PER_SYNC["cuda"])
    finally:
        dist.destroy_process_group()
    assert run.PER_SYNC["cuda"] > 1 and len(ops) == 1 + 3 * run.PER_SYNC["cuda"] and len(syncs) == 1 + 3
    assert seconds > 0
