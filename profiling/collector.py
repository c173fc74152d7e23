"""The collector both trainers call around every step.

Usage on every rank::

    collector = StepCollector.for_rank(ctx, tp_rank=..., pp_rank=..., dp_rank=...)
    for step in range(start, end + 1):
        collector.start_step(step)
        ...                                 # forward/backward/optimizer
        collector.end_step(step, loss=..., lr=..., grad_norm=...)
    collector.close()
"""

from __future__ import annotations

import socket
import time
from typing import Any

from profiling.records import RecordWriter
from profiling.schema import SCHEMA_VERSION


def _rss_bytes() -> int | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # psutil missing: RSS is optional
        return None


class StepCollector:
    def __init__(self, *, run_id: str, records_dir, rank: int, world_size: int, job_id: str | None, restart: int,
                 tokens_per_step: int, coords: dict[str, int], enabled: bool = True, summary_interval: int = 10,
                 log=None):
        self.run_id, self.rank, self.world_size = run_id, rank, world_size
        self.job_id, self.restart = job_id, restart
        self.tokens_per_step = tokens_per_step
        self.coords = coords
        self.enabled = enabled
        self.summary_interval = summary_interval
        self.log = log
        self.node = socket.gethostname()
        self.writer = RecordWriter(records_dir, rank) if enabled else None
        self._t0 = 0.0
        self._data_s = 0.0

    @classmethod
    def for_rank(cls, ctx, *, tp_rank: int = 0, pp_rank: int = 0, dp_rank: int | None = None) -> "StepCollector":
        r = ctx.recipe
        return cls(run_id=ctx.run.run_id, records_dir=ctx.run.records_dir, rank=ctx.rank,
                   world_size=ctx.dist.world_size, job_id=ctx.dist.job_id, restart=ctx.dist.restart_count,
                   tokens_per_step=ctx.layout.global_batch_size * r.model.seq_length,
                   coords={"tp_rank": tp_rank, "pp_rank": pp_rank, "dp_rank": ctx.rank if dp_rank is None else dp_rank},
                   enabled=r.profiling.enabled, summary_interval=r.profiling.summary_interval,
                   log=ctx.info)

    def start_step(self, step: int) -> None:
        self._data_s = 0.0
        self._t0 = time.perf_counter()

    def add_data_time(self, seconds: float) -> None:
        self._data_s += seconds

    def end_step(self, step: int, *, loss: float | None = None, lr: float | None = None,
                 grad_norm: float | None = None, skipped: bool | None = None) -> dict[str, Any]:
        dt = time.perf_counter() - self._t0
        tps = self.tokens_per_step / dt if dt > 0 else 0.0
        record = {
            "schema_version": SCHEMA_VERSION, "run_id": self.run_id, "job_id": self.job_id, "restart": self.restart,
            "rank": self.rank, "node": self.node, **self.coords, "step": step, "time": time.time(),
            "step_time_s": dt, "data_time_s": self._data_s, "tokens": self.tokens_per_step, "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / self.world_size,
            "loss": None if loss is None else float(loss), "lr": None if lr is None else float(lr),
            "grad_norm": None if grad_norm is None else float(grad_norm), "rss_bytes": _rss_bytes(),
            "skipped": skipped,
        }
        if self.writer is not None:
            self.writer.write(record)
        if self.log and step % self.summary_interval == 0:
            loss_s = f" loss {loss:.4f}" if loss is not None else ""
            self.log("step %d%s | %.3f s/step | %.0f tok/s", step, loss_s, dt, tps)
        return record

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
