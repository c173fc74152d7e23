"""Many recipe variants (DeepSpeed, FSDP / DDP) in one process group: one launch (~10 s here) instead of one per
configuration.

Each variant is a full recipe run through its backend's real ``run(ctx)`` (the backend table's trainer) in its own
run folder (records, checkpoints, manifest), optionally stopped after a step (a stop flag raised on the last rank
only, so the ranks must agree) and then resumed in the same processes, optionally with its own environment variables
(``"env"``: a test-only fault, set for that variant only). Used by the DeepSpeed and FSDP integration
tests and ``benchmarks/deepspeed_stages.py``::

    results = launch([{"name": "z1", "recipe": {...raw recipe...}, "stop_after": 4}], world_size=2, workdir=tmp)
    results["z1"]["loss"], results["z1"]["val_loss"]  # per-step losses (steps 1..train_iters), validation by step
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hpc_tools.testing.spawn import spawn_ranks


class StopAfter:
    """Stands in for the hang watchdog: raises this rank's stop flag once ``step`` has completed."""

    def __init__(self, stop, step: int):
        self.stop, self.step = stop, step
        self.started_step: int | None = None  # as the watchdog's: the first step this start completed

    def beat(self, step: int) -> None:
        if self.started_step is None:
            self.started_step = step
        if step >= self.step:
            self.stop.requested = True

    def outside_step(self, what: str):
        """As the watchdog's: the Saver's save runs outside the step clock (there is none to stop here)."""
        return contextlib.nullcontext()

    def progress(self) -> None:
        """As the watchdog's: a save reports progress (nothing to reset here)."""


def launch(variants: list[dict[str, Any]], world_size: int, workdir: str | Path, timeout_s: float = 540,
           env: dict[str, str] | None = None, backend: str = "gloo") -> dict[str, Any]:
    """``python -m hpc_tools.testing.matrix --spec SPEC --out OUT`` on ``world_size`` local ranks (``backend`` nccl for
    GPU recipes); rank 0's results by variant name."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec, out = workdir / "matrix_spec.json", workdir / "matrix_result.json"
    spec.write_text(json.dumps({"variants": variants, "root": str(workdir / "runs"), "backend": backend}))
    cmd = [sys.executable, "-m", "hpc_tools.testing.matrix", "--spec", str(spec), "--out", str(out)]
    ranks = spawn_ranks(cmd, world_size, env=env, timeout_s=timeout_s, log_dir=workdir / "matrix_logs", check=True)
    if not out.is_file():
        raise RuntimeError(f"matrix launch wrote no {out.name}; rank 0 log tail:\n{ranks[0].log[-4000:]}")
    return json.loads(out.read_text())


def run_variant(variant: dict[str, Any], root: Path) -> dict[str, Any]:
    """Run one variant on this rank (all ranks call it together); rank 0's view of its records."""
    import torch.distributed as dist

    from hpc_tools import backends
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.load import dump_resolved, resolve
    from hpc_tools.registry import RunFolder

    recipe = resolve(variant["recipe"], source=variant["name"])
    trainer = backends.load(backends.of(recipe).trainer)
    path = root / variant["name"]
    if dist.get_rank() == 0:
        RunFolder.create(root, variant["name"], dump_resolved(recipe), "", {"executor": "matrix"})
    dist.barrier()
    layout = ParallelLayout.from_recipe(recipe)
    phases = [variant.get("stop_after"), None] if variant.get("stop_after") else [None]
    walls = []
    with variant_env(variant.get("env") or {}):
        for stop_after in phases:
            walls.append(run_phase(trainer, recipe, layout, path, stop_after))
    return {"run_dir": str(path), "wall_s": walls, **read_records(path)} if dist.get_rank() == 0 else {}


@contextlib.contextmanager
def variant_env(env: dict[str, str]):
    """``env`` in this process's environment for one variant (a test-only fault such as HPC_TOOLS_TEST_SLOW_RANK,
    read when the run starts), then the environment as it was: the next variant does not inherit it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_phase(trainer, recipe, layout, path: Path, stop_after: int | None) -> float:
    """One start of the variant's trainer (stopped after ``stop_after`` when given); its wall seconds."""
    from hpc_tools.registry import RunFolder
    from hpc_tools.runtime.context import RankContext
    from hpc_tools.runtime.distenv import DistEnv
    from hpc_tools.runtime.preemption import StopFlag

    ctx = RankContext(recipe=recipe, layout=layout, dist=DistEnv.from_environ(), run=RunFolder(path), stop=StopFlag())
    if stop_after and ctx.rank == ctx.dist.world_size - 1:
        ctx.watchdog = StopAfter(ctx.stop, stop_after)
    t0 = time.perf_counter()
    trainer(ctx)
    wall = time.perf_counter() - t0
    gc.collect()
    return wall


def read_records(run_dir: Path) -> dict[str, Any]:
    """Rank 0's per-step series (validation loss by step), and how many records each rank wrote."""
    from profiling.records import read_jsonl

    per_rank = {}
    for f in sorted((run_dir / "records").glob("rank*.jsonl")):
        per_rank[f.stem] = list(read_jsonl(f))
    rows = per_rank.get("rank00000", [])
    return {"steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows], "lr": [r["lr"] for r in rows],
            "grad_norm": [r["grad_norm"] for r in rows], "step_time_s": [r["step_time_s"] for r in rows],
            "val_loss": {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None},
            "records_per_rank": {k: len(v) for k, v in per_rank.items()},
            "loss_per_rank": {k: [r["loss"] for r in v] for k, v in per_rank.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.testing.matrix", description=__doc__)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {os.environ['RANK']}] %(message)s")
    spec = json.loads(Path(args.spec).read_text())
    if spec["backend"] == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    from hpc_tools.runtime.distenv import join_world

    join_world(spec["backend"])
    results = {}
    for variant in spec["variants"]:
        t0 = time.perf_counter()
        results[variant["name"]] = run_variant(variant, Path(spec["root"]))
        if dist.get_rank() == 0:
            logging.info("variant %s: %.1f s", variant["name"], time.perf_counter() - t0)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(results))
        os.replace(tmp, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
