"""Many FSDP / DDP recipe variants in one process group: one launch instead of one per configuration.

The same shape as ``hpc_tools.testing.deepspeed_matrix`` (whose stop helper and record reader it uses): each variant
is a full recipe run through its backend's real ``run(ctx)`` (the backend table's trainer) in its own run folder,
optionally stopped after a step (a stop flag raised on the last rank only) and resumed in the same processes::

    results = launch([{"name": "fs", "recipe": {...raw recipe...}, "stop_after": 4}], world_size=4, workdir=tmp)
    results["fs"]["loss"], results["fs"]["val_loss"]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hpc_tools.testing.deepspeed_matrix import StopAfter, launch_module, read_records


def launch(variants: list[dict[str, Any]], world_size: int, workdir: str | Path, timeout_s: float = 540,
           env: dict[str, str] | None = None, backend: str = "gloo") -> dict[str, Any]:
    """Run the variants on ``world_size`` local ranks (``backend`` nccl for GPU recipes); rank 0's results by
    name."""
    return launch_module("hpc_tools.testing.fsdp_matrix", variants, world_size, workdir, timeout_s, env, backend)


def run_variant(variant: dict[str, Any], root: Path) -> dict[str, Any]:
    """Run one variant on this rank (all ranks call it together); rank 0's view of its records."""
    import torch.distributed as dist

    from hpc_tools import backends
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.load import dump_resolved, resolve
    from hpc_tools.registry import RunFolder
    from hpc_tools.runtime.context import RankContext
    from hpc_tools.runtime.distenv import DistEnv
    from hpc_tools.runtime.preemption import StopFlag

    recipe = resolve(variant["recipe"], source=variant["name"])
    trainer = backends.load(backends.of(recipe).trainer)
    path = root / variant["name"]
    if dist.get_rank() == 0:
        RunFolder.create(root, variant["name"], dump_resolved(recipe), "", {"executor": "matrix"})
    dist.barrier()
    layout = ParallelLayout.from_recipe(recipe)
    phases = [variant.get("stop_after"), None] if variant.get("stop_after") else [None]
    walls = []
    for stop_after in phases:
        ctx = RankContext(recipe=recipe, layout=layout, dist=DistEnv.from_environ(), run=RunFolder(path),
                          stop=StopFlag())
        if stop_after and ctx.rank == ctx.dist.world_size - 1:
            ctx.watchdog = StopAfter(ctx.stop, stop_after)
        t0 = time.perf_counter()
        trainer(ctx)
        walls.append(time.perf_counter() - t0)
        gc.collect()
    if dist.get_rank() != 0:
        return {}
    from profiling.records import read_jsonl

    rows = list(read_jsonl(path / "records" / "rank00000.jsonl"))
    val = {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
    return {"run_dir": str(path), "wall_s": walls, "val_loss": val, **read_records(path)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.testing.fsdp_matrix", description=__doc__)
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
    dist.init_process_group(spec["backend"])
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
