"""backend.kind: comm_check — no model; every rank joins the process group, checks an all-reduce result and times
all-reduces of growing size (bus bandwidth in the nccl-tests convention). A cluster smoke test that still writes
the standard step records, one per size, through the same loop as the trainers (``hpc_tools.train.loop``).
"""

from __future__ import annotations

import time
from pathlib import Path

from hpc_tools.runtime.context import RankContext
from hpc_tools.train import loop
from hpc_tools.train.engine import StepResult

SIZES_BYTES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)


def run(ctx: RankContext) -> None:
    """Check and time all-reduces on this rank."""
    loop.run(ctx, CommCheck)


class CommCheck:
    """``engine.RankJob`` without a model: a step is one all-reduce of the next size of ``SIZES_BYTES``."""

    checkpoints = False

    def __init__(self, ctx: RankContext):
        import torch
        import torch.distributed as dist

        self.ctx, self.device, self.world = ctx, ctx.device, ctx.dist.world_size
        n = self.world
        check = torch.tensor([float(ctx.rank)], device=self.device)
        dist.all_reduce(check)
        expected = n * (n - 1) / 2
        if check.item() != expected:
            raise RuntimeError(f"all-reduce of ranks gave {check.item()}, expected {expected}")
        ctx.info("rendezvous ok: %d ranks on %s, all-reduce sum %.0f", n, ctx.dist.master_addr, check.item())
        # One buffer per size, allocated here so that no step times an allocation. The values do not matter (only
        # the bytes moved): the sums grow with every reuse, up to inf in float32, which reduces at the same speed.
        self.buffers = [torch.ones(size // 4, dtype=torch.float32, device=self.device) for size in SIZES_BYTES]

    def describe(self) -> str:
        return f"comm_check: all-reduce of {SIZES_BYTES[0]}..{SIZES_BYTES[-1]} bytes on {self.world} ranks"

    def coords(self) -> dict[str, int]:
        return {}

    def resume(self, source: Path) -> int:
        raise NotImplementedError("comm_check keeps no checkpoints")

    def batch(self, step: int):
        """The buffer of this step's size: the sizes take turns, smallest first."""
        return self.buffers[(step - 1) % len(SIZES_BYTES)]

    def step(self, step: int, batch) -> StepResult:
        """Time one all-reduce of ``batch``; the note carries its time and bus bandwidth."""
        import torch
        import torch.distributed as dist

        n, size = self.world, batch.numel() * batch.element_size()
        t0 = time.perf_counter()
        dist.all_reduce(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        busbw = size / dt * 2 * (n - 1) / n / 1e9 if n > 1 else 0.0
        return StepResult(note=f"all_reduce {size:8d} bytes: {dt * 1e3:.3f} ms, busbw {busbw:.3f} GB/s")

    def evaluate(self, batches: list) -> None:
        """No model: nothing to evaluate (the validation loss stays None)."""
        return None

    def start_background_writer(self) -> None:
        raise NotImplementedError("comm_check keeps no checkpoints")

    def write_checkpoint(self, folder: Path, step: int, background: bool) -> None:
        raise NotImplementedError("comm_check keeps no checkpoints")

    def checkpoint_meta(self, step: int) -> dict:
        raise NotImplementedError("comm_check keeps no checkpoints")

    def close(self) -> None:
        self.buffers = []
