"""backend.kind: comm_check — no model; every rank joins the process group, checks an all-reduce result and times
all-reduces of growing size (bus bandwidth in the nccl-tests convention). A cluster smoke test that still writes
the standard step records, one per size.
"""

from __future__ import annotations

import time

from hpc_tools.runtime.context import RankContext
from profiling.collector import StepCollector

SIZES_BYTES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)


def run(ctx: RankContext) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", ctx.dist.local_rank) if ctx.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(ctx.dist_backend, rank=ctx.rank, world_size=ctx.dist.world_size)
    try:
        n = ctx.dist.world_size
        check = torch.tensor([float(ctx.rank)], device=device)
        dist.all_reduce(check)
        expected = n * (n - 1) / 2
        if check.item() != expected:
            raise RuntimeError(f"all-reduce of ranks gave {check.item()}, expected {expected}")
        ctx.info("rendezvous ok: %d ranks on %s, all-reduce sum %.0f", n, ctx.dist.master_addr, check.item())
        collector = StepCollector.for_rank(ctx)
        iters = ctx.recipe.training.train_iters
        for step in range(1, iters + 1):
            size = SIZES_BYTES[(step - 1) % len(SIZES_BYTES)]
            buf = torch.ones(size // 4, dtype=torch.float32, device=device)
            collector.start_step(step)
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            busbw = size / dt * 2 * (n - 1) / n / 1e9 if n > 1 else 0.0
            collector.end_step(step, loss=None)
            ctx.heartbeat(step)
            if step % ctx.recipe.training.log_interval == 0 or step == iters:
                ctx.info("all_reduce %8d bytes: %.3f ms, busbw %.3f GB/s", size, dt * 1e3, busbw)
            if ctx.agree_stop(device):
                ctx.finish_preempted(step)
                break
        collector.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()
