"""Preflight's second looks (``run.look_until_settled``) end on every rank together: two real gloo ranks, rank 1 slow
in every look and already past its own deadline, rank 0 not. Deciding by each rank's own clock, rank 1 stopped after
one look while rank 0 looked again and waited at the gather until the group's timeout."""

from __future__ import annotations

import math
import multiprocessing as mp
import time

import pytest

pytest.importorskip("torch.distributed")

TIMEOUT_S = 20


def _rank(rank: int, init: str, deadline_in_s: float, out) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from hpc_tools.runtime.preflight import run
    from hpc_tools.runtime.preflight.verdict import RankResult

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    mine = RankResult(rank=rank, node=f"n{rank}")

    def look(number: int) -> None:  # rank 1's node is 10x slower in every look
        mine.gemm_tflops, mine.mem_gbps = (1.0, 1.0) if rank == 1 else (10.0, 10.0)

    try:
        looks = run.look_until_settled(look, mine, 2, time.perf_counter() + deadline_in_s)
        out.put((rank, looks))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def run_two(tmp_path, deadlines: tuple[float, float]) -> dict[int, object]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_rank, args=(r, init, deadlines[r], out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=TIMEOUT_S * 3) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def test_a_rank_past_its_deadline_ends_the_looks_of_every_rank(tmp_path):
    got = run_two(tmp_path, (math.inf, -1.0))
    assert got[0] == got[1] == [["n1"]], got  # one look, on both ranks, naming the slow node


def test_a_node_slow_in_every_look_is_looked_at_second_looks_times_more(tmp_path):
    from hpc_tools.runtime.preflight.run import SECOND_LOOKS

    got = run_two(tmp_path, (math.inf, math.inf))
    assert got[0] == got[1] == [["n1"]] * (SECOND_LOOKS + 1), got
