"""The process groups preflight makes (issue 46 item 12): its collectives over every rank run on the default group,
never on a second world-size communicator (on GPUs a second NCCL communicator over every rank: its buffers and
connections, for nothing). Two real gloo ranks run the whole ``preflight.run.check``, standing for two nodes, with
``dist.new_group`` recorded."""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytest.importorskip("torch.distributed")

TIMEOUT_S = 60


def _rank(rank: int, init: str, run_dir: str, raw: dict, out) -> None:
    try:
        _check(rank, init, run_dir, raw, out)
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which would otherwise wait for the queue
        out.put((rank, f"{type(exc).__name__}: {exc}", None))


def _check(rank: int, init: str, run_dir: str, raw: dict, out) -> None:
    import os
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from hpc_tools.layout import ParallelLayout
    from hpc_tools.registry import RunFolder
    from hpc_tools.runtime.preflight import run

    os.environ[run.RANKS_PER_NODE_ENV] = "1"  # each rank stands for a node
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    made = []
    real = dist.new_group

    def new_group(*args, **kwargs):
        made.append(sorted(kwargs.get("ranks") or args[0]))
        return real(*args, **kwargs)

    dist.new_group = new_group
    from hpc_tools.recipe.load import resolve

    folder = RunFolder(run_dir)
    recipe = resolve(raw)
    ctx = SimpleNamespace(recipe=recipe, layout=ParallelLayout.from_recipe(recipe), device=torch.device("cpu"),
                          rank=rank, is_rank0=rank == 0, run=folder, run_dir=folder.path, dist_backend="gloo",
                          collective_timeout=timedelta(seconds=TIMEOUT_S), info=lambda *a: None,
                          dist=SimpleNamespace(world_size=2, executor="local", restart_count=0,
                                               master_addr="127.0.0.1", master_port=0))
    try:
        report = run.check(ctx, "auto")
        out.put((rank, made, len(report.rows)))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}", None))
    finally:
        dist.destroy_process_group()


def test_preflight_times_its_world_collectives_on_the_default_group(tmp_path):
    from hpc_tools.recipe.load import resolve
    from hpc_tools.submission import new_run
    from tests.unit.test_preflight import small_recipe

    raw = small_recipe(preflight="strict", preflight_budget_s=2)
    folder = new_run(resolve(raw), tmp_path / "runs", "local", "preflight.yaml")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_rank, args=(r, init, str(folder.path), raw, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {r: (made, rows) for r, made, rows in (out.get(timeout=TIMEOUT_S * 3) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got[0][1] == got[1][1] == 2, got  # the check ran to its report on both ranks (a row per rank)
    assert [0, 1] not in got[0][0] and got[0][0] == got[1][0], got
